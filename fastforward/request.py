"""Engine-side state of one sequence being generated."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from fastforward.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(slots=True, eq=False)
class Request:
    """One sequence. The only progress counter is ``num_computed_tokens``: prefill, chunked
    prefill, decode and recompute after preemption all advance it towards ``num_tokens``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    max_tokens: int = 16  # resolved limit on generated tokens (params and context length)
    arrival_time: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (later issue)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Per generated token: (sampled logprob, {token id: (logprob, rank)}) when logprobs requested.
    output_logprobs: list = field(default_factory=list)
    # Prompt token i + 1 scored from position i: ``PromptTokenLogprobs`` in prompt order, filled
    # chunk by chunk during prefill when ``sampling_params.prompt_logprobs`` is set.
    prompt_logprobs: list = field(default_factory=list)
    # llguidance matcher of a structured-output request: fed every generated token.
    grammar: Any = None
    # Set when ``structured_outputs.finish_reserve`` narrowed a token choice to end sooner.
    finish_steered: bool = False
    finish_scan: Any = None  # structured_finish.JsonScan of the output so far, when steered
    # Speculative decoding: tokens proposed to follow ``all_token_ids`` (verified next step),
    # with the ``[k, V]`` distribution a draft model sampled them from (None: drafted
    # deterministically, e.g. n-gram lookup or greedy). Counters: drafts proposed / accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: Any = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0  # steps that verified drafts of this request

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True until every prompt token after the first has been scored (such a request must
        compute its whole prompt: prefix-cache hits would skip the logits it needs)."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    def clear_drafts(self) -> None:
        self.spec_token_ids = []
        self.spec_draft_probs = None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
