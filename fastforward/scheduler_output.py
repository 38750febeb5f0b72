"""The typed contract between the scheduler and the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastforward.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """Compute ``num_new_tokens`` tokens of ``request`` starting at its ``num_computed_tokens``.

    ``block_ids[g]`` is the request's whole block table for KV cache group ``g``.
    ``sample`` is True when this step reaches the end of the known tokens, so the logits of the
    last computed token are needed to pick the next one. The last ``num_spec_tokens`` of the
    new tokens are the request's draft tokens (``request.spec_token_ids``), whose logits verify
    them: a speculating request gets ``num_spec_tokens + 1`` logits rows.
    """

    request: Request
    num_new_tokens: int
    block_ids: tuple[list[int], ...]
    num_spec_tokens: int = 0

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def sample(self) -> bool:
        return self.start + self.num_new_tokens - self.num_spec_tokens == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step computes: known ones, then the drafts."""
        known = self.request.all_token_ids[self.start : self.start + self.num_new_tokens]
        if not self.num_spec_tokens:
            return known
        return known + self.request.spec_token_ids[: self.num_spec_tokens]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
