"""Turns engine-side request state into user-facing ``RequestOutput``s: incremental text, stop
strings, logprobs, and the fan-in of ``n > 1`` child sequences into one output."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastforward.detokenizer import IncrementalDetokenizer
from fastforward.layers.sampler import SampledToken
from fastforward.loader.tokenizer import Tokenizer
from fastforward.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from fastforward.request import Request


@dataclass(slots=True)
class SequenceState:
    """Output-side state of one generated sequence (one child of a request)."""

    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""  # released text only grows, so streaming deltas are suffixes of it
    num_processed: int = 0  # output tokens already fed to the detokenizer
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0


@dataclass(slots=True)
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceState] = field(default_factory=list)
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # built once the prompt is fully scored
    final_only: bool = False  # step() returns its output once, finished (Engine.add_request)

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.sequences)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def record_logprobs(self, seq: SequenceState, sampled: SampledToken) -> None:
        """Keep the logprobs of one sampled token (when the request asked for them)."""
        if seq.logprobs is None or sampled.logprob is None:
            return
        entry = {}
        for token_id, logprob, rank in sampled.top_logprobs or []:
            entry[token_id] = Logprob(logprob, rank, self._piece(token_id))
        if sampled.token_id not in entry:
            piece = self._piece(sampled.token_id)
            entry[sampled.token_id] = Logprob(sampled.logprob, sampled.rank, piece)
        seq.logprobs.append(entry)
        seq.cumulative_logprob += sampled.logprob

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def process(self, seq: SequenceState) -> str | None:
        """Feed new tokens to the detokenizer; returns a stop string if one was hit."""
        req = seq.request
        new = req.output_token_ids[seq.num_processed :]
        stop = None
        # One token at a time: when a step gained several (speculative decoding), the output
        # ends at the token that completed a stop string, as it would decoding one by one.
        for i, token_id in enumerate(new):
            stop = seq.detokenizer.update([token_id])
            if stop is not None:
                self._drop_last(seq, len(new) - i - 1)
                break
        seq.num_processed = len(req.output_token_ids)
        final = stop is not None or req.is_finished
        seq.text += seq.detokenizer.take_delta(final=final)
        return stop

    @staticmethod
    def _drop_last(seq: SequenceState, n: int) -> None:
        """Remove the last ``n`` generated tokens (and their logprobs) of a sequence."""
        if n <= 0:
            return
        req = seq.request
        dropped = req.output_token_ids[-n:]
        del req.output_token_ids[-n:]
        del req.all_token_ids[-n:]
        if seq.logprobs is not None:
            for token_id, entry in zip(dropped, seq.logprobs[-n:], strict=True):
                seq.cumulative_logprob -= entry[token_id].logprob
            del seq.logprobs[-n:]

    def make_output(self, parent: ParentState) -> RequestOutput:
        outputs = [self._completion(i, s) for i, s in enumerate(parent.sequences)]
        first = parent.sequences[0].request
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time,
            finished_time=first.finished_time if parent.finished else None,
            num_preemptions=sum(s.request.num_preemptions for s in parent.sequences),
            num_draft_tokens=sum(s.request.num_draft_tokens for s in parent.sequences),
            num_accepted_tokens=sum(s.request.num_accepted_tokens for s in parent.sequences),
            num_spec_steps=sum(s.request.num_spec_steps for s in parent.sequences),
        )
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=parent.finished,
            metrics=metrics,
            num_cached_tokens=first.num_cached_tokens,
            error=parent.error,
            prompt_logprobs=self._prompt_logprobs(parent),
        )

    def _prompt_logprobs(self, parent: ParentState) -> PromptLogprobs | None:
        first = parent.sequences[0].request
        if parent.prompt_logprobs is None and (
            first.sampling_params.prompt_logprobs is not None and not first.needs_prompt_logprobs
        ):
            entries: PromptLogprobs = [None]
            for t in first.prompt_logprobs:
                entry = {
                    tid: Logprob(lp, k + 1, self._piece(tid)) for k, (tid, lp) in enumerate(t.top)
                }
                if t.token_id not in entry:
                    entry[t.token_id] = Logprob(t.logprob, t.rank, self._piece(t.token_id))
                entries.append(entry)
            parent.prompt_logprobs = entries
        return parent.prompt_logprobs

    @staticmethod
    def _completion(index: int, seq: SequenceState) -> CompletionOutput:
        req = seq.request
        finish = req.status.value if req.is_finished else None
        return CompletionOutput(
            index=index,
            text=seq.text,
            token_ids=list(req.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            finish_reason=finish,
            stop_reason=req.stop_reason,
        )
