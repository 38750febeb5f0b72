"""Proposers that run a model: a separate draft model with its own paged KV cache, and the
target itself through a subset of its layers (self-speculative, LayerSkip / Draft & Verify)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastforward.kv.manager import KVCacheManager
from fastforward.layers.sampler import Sampler, filter_logits, sample_probs
from fastforward.request import Request
from fastforward.runner import ModelRunner
from fastforward.scheduler_output import ScheduledRequest, SchedulerOutput
from fastforward.spec_decode.proposer import Draft

DRAFT_SALT = 0x5D5D_0001  # separates a seeded request's draft draws from its target draws


@dataclass(slots=True, eq=False)
class DraftSequence:
    """A request as a drafter's KV cache sees it: the tokens it has KV for (the first
    ``num_computed_tokens`` of ``all_token_ids``) and the tokens being drafted after them."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    needs_prompt_logprobs: bool = False
    verified: int = 0  # leading tokens known to be the target's (drafts follow them)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def sample_drafts(
    sampler: Sampler, logits: torch.Tensor, requests: list[Request], step: int
) -> tuple[list[int], list[torch.Tensor | None]]:
    """One draft token per row of ``logits`` [R, V]: the argmax for greedy requests, else a
    sample from the request's own temperature / top-k / top-p / min-p distribution ``q``,
    returned with it (the verifier's acceptance test needs ``q``). ``step``: drafts already
    made for these requests this round."""
    tokens = logits.argmax(dim=-1).tolist()
    probs: list[torch.Tensor | None] = [None] * len(requests)
    rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
    if rows:
        reqs = [requests[i] for i in rows]
        q = filter_logits(logits[rows].clone(), reqs, sampler.filter_kernels)
        q = torch.softmax(q, dim=-1)  # [R', V]
        gens = [
            sampler.generator(r, r.num_output_tokens + step, q.device, DRAFT_SALT) for r in reqs
        ]
        picked = sample_probs(q, gens)
        for j, i in enumerate(rows):
            tokens[i], probs[i] = picked[j], q[j]
    return tokens, probs


def _draft(tokens: list[int], probs: list[torch.Tensor | None]) -> Draft:
    if not tokens or probs[0] is None:
        return Draft(tokens)
    return Draft(tokens, torch.stack(probs))


class DraftModelProposer:
    """A smaller model of the same tokenizer drafts ``k`` tokens autoregressively.

    Each round it first catches up on the tokens it has no KV for (the whole prompt the first
    time, then the target's accepted tokens), chunked to ``max_num_batched_tokens``, and the
    last of those passes yields draft 1; drafts 2..k take one batched one-token pass each. KV it
    computed for drafts the target then rejected is recomputed next round. A request its cache
    cannot hold simply gets no drafts.
    """

    def __init__(
        self,
        runner: ModelRunner,
        kv: KVCacheManager,
        sampler: Sampler,
        max_num_batched_tokens: int,
    ) -> None:
        self.runner, self.kv, self.sampler = runner, kv, sampler
        self.budget = max_num_batched_tokens
        self.seqs: dict[str, DraftSequence] = {}

    def release(self, keep: set[str]) -> None:
        for rid in [r for r in self.seqs if r not in keep]:
            self.kv.free(self.seqs.pop(rid))

    def _sync(self, req: Request, k: int) -> DraftSequence | None:
        """The request's draft sequence with KV kept only where its tokens still hold, and
        room for ``k`` more drafts; None when the draft cache is full."""
        seq = self.seqs.get(req.request_id)
        if seq is None:
            seq = self.seqs[req.request_id] = DraftSequence(req.request_id, [])
        # The target's tokens only grow, so the first ``verified`` still hold; after them
        # come last round's drafts, whose KV holds up to the first one the target rejected.
        limit = min(seq.num_computed_tokens, req.num_tokens - 1)
        old, new = seq.all_token_ids, req.all_token_ids
        valid = min(seq.verified, limit)
        while valid < limit and old[valid] == new[valid]:
            valid += 1
        seq.all_token_ids = list(new)
        seq.num_computed_tokens = valid
        seq.verified = req.num_tokens
        # Positions valid .. num_tokens - 1 are computed now, then k - 1 draft positions.
        need = req.num_tokens - valid + k - 1
        if not self.kv.allocate_slots(seq, need):
            self.kv.free(seq)
            del self.seqs[req.request_id]
            return None
        return seq

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]:
        seqs = [self._sync(r, k) for r, k in zip(requests, num_tokens, strict=True)]
        live = [i for i, s in enumerate(seqs) if s is not None]
        tokens: dict[int, list[int]] = {i: [] for i in live}
        probs: dict[int, list] = {i: [] for i in live}
        # Catch-up passes; a sequence reaching its last known token yields draft 1.
        pending = list(live)
        while pending:
            batch, budget = [], self.budget
            for i in pending:
                if budget <= 0:
                    break
                s = seqs[i]
                n = min(s.num_tokens - s.num_computed_tokens, budget)
                batch.append((i, n))
                budget -= n
            self._run(batch, seqs, requests, tokens, probs, step=0)
            pending = [i for i in pending if seqs[i].num_computed_tokens < seqs[i].num_tokens]
        for step in range(1, max((num_tokens[i] for i in live), default=0)):
            batch = [(i, 1) for i in live if num_tokens[i] > step]
            for i, _ in batch:
                seqs[i].all_token_ids.append(tokens[i][-1])
            self._run(batch, seqs, requests, tokens, probs, step)
        out = [Draft([]) for _ in requests]
        for i in live:
            out[i] = _draft(tokens[i], probs[i])
        return out

    def _run(self, batch, seqs, requests, tokens, probs, step: int) -> None:
        sched = SchedulerOutput(
            [ScheduledRequest(seqs[i], n, self.kv.get_block_ids(seqs[i])) for i, n in batch]
        )
        result = self.runner.execute(sched)
        sampled_idx = [i for i, n in batch if seqs[i].num_computed_tokens + n == seqs[i].num_tokens]
        for i, n in batch:
            seqs[i].num_computed_tokens += n
        if not sampled_idx:
            return
        picked, q = sample_drafts(
            self.sampler, result.logits, [requests[i] for i in sampled_idx], step
        )
        for j, i in enumerate(sampled_idx):
            tokens[i].append(picked[j])
            probs[i].append(q[j])


class LayerSkipProposer:
    """The target drafts for itself through ``layer_ids`` only (then its final norm and LM
    head), reading the target's own KV cache for the context.

    Draft passes write the kept layers' K/V at the draft positions into the target's cache,
    into slots reserved here through the scheduler's KV manager; the verification pass then
    overwrites every layer at those positions, so nothing a draft wrote survives.
    """

    def __init__(
        self,
        runner: ModelRunner,
        kv: KVCacheManager,
        sampler: Sampler,
        layer_ids: Sequence[int],
    ) -> None:
        self.runner, self.kv, self.sampler = runner, kv, sampler
        self.layer_ids = list(layer_ids)

    def release(self, keep: set[str]) -> None:
        pass

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]:
        live = [
            i
            for i, (r, k) in enumerate(zip(requests, num_tokens, strict=True))
            if self.kv.allocate_slots(r, k)
        ]
        seqs = {
            i: DraftSequence(
                requests[i].request_id,
                list(requests[i].all_token_ids),
                requests[i].num_computed_tokens,
            )
            for i in live
        }
        tokens: dict[int, list[int]] = {i: [] for i in live}
        probs: dict[int, list] = {i: [] for i in live}
        for step in range(max((num_tokens[i] for i in live), default=0)):
            batch = [i for i in live if num_tokens[i] > step]
            sched = SchedulerOutput(
                [ScheduledRequest(seqs[i], 1, self.kv.get_block_ids(requests[i])) for i in batch]
            )
            result = self.runner.execute(sched, self.layer_ids)
            picked, q = sample_drafts(
                self.sampler, result.logits, [requests[i] for i in batch], step
            )
            for j, i in enumerate(batch):
                seqs[i].num_computed_tokens += 1
                seqs[i].all_token_ids.append(picked[j])
                tokens[i].append(picked[j])
                probs[i].append(q[j])
        out = [Draft([]) for _ in requests]
        for i in live:
            out[i] = _draft(tokens[i], probs[i])
        return out
