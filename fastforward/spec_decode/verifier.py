"""Verification of draft tokens from one batched target pass.

A request verifying ``k`` drafts ``d_1..d_k`` has ``k + 1`` logits rows: row ``j`` is the
target's next-token distribution after the drafts ``d_1..d_j``. Each row goes through the same
processing as a plain sampling step (grammar mask, penalties and ``min_tokens`` seeing the drafts
before it as output, temperature, min-p, top-k, top-p), so:

- greedy requests accept drafts while ``d_{j+1} == argmax(row j)`` and add that row's argmax at
  the first mismatch (or after the last draft): exactly the tokens the target alone produces;
- sampled requests use the rejection rule of Leviathan et al. / Chen et al.: accept ``d_{j+1}``
  with probability ``min(1, p_j(d) / q_j(d))``; at the first rejection draw from
  ``norm(max(p_j - q_j, 0))``; after ``k`` acceptances draw a bonus token from ``p_k``. The
  output then follows the target's distribution whatever the draft ``q`` was. A draft without a
  distribution (n-gram lookup, greedy drafts) is a point mass: ``q_j(d) = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastforward.layers.sampler import (
    SampledToken,
    Sampler,
    apply_min_tokens,
    apply_penalties,
    build_sampled_tokens,
    filter_logits,
    sample_probs,
)
from fastforward.request import Request
from fastforward.structured_outputs import GrammarCompiler, bitmask_to_bool

VERIFY_SALT = 0x5D5D_0002  # a seeded request's verification draws, apart from its sampling


@dataclass(slots=True)
class DraftRow:
    """A request seen from one verification row: the drafts before the row count as output
    (for penalties and ``min_tokens``), as they would when decoding one token at a time."""

    request: Request
    drafts: list[int]

    @property
    def sampling_params(self):
        return self.request.sampling_params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.drafts

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.drafts)

    @property
    def eos_token_id(self) -> int | None:
        return self.request.eos_token_id


class DraftVerifier:
    def __init__(self, sampler: Sampler, grammars: GrammarCompiler | None = None) -> None:
        self.sampler = sampler
        self.grammars = grammars

    def __call__(
        self, logits: torch.Tensor, requests: list[Request], num_spec: list[int]
    ) -> list[list[SampledToken]]:
        """``logits`` [sum(k_i + 1), V] of requests verifying ``num_spec[i]`` drafts each (their
        ``spec_token_ids``) -> the tokens each request gains: accepted drafts and one more."""
        rows = [
            DraftRow(r, r.spec_token_ids[:j])
            for r, k in zip(requests, num_spec, strict=True)
            for j in range(k + 1)
        ]
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} verification rows")
        logits = logits.to(torch.float32, copy=True)
        starts = [0]
        for k in num_spec:
            starts.append(starts[-1] + k + 1)
        if self.grammars is not None:
            self._grammar_masks(logits, requests, num_spec, starts)
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        apply_penalties(logits, rows)
        self.sampler.dry(logits, rows)
        apply_min_tokens(logits, rows)
        argmax = logits.argmax(dim=-1).tolist()
        random_rows = [i for i, row in enumerate(rows) if not row.sampling_params.is_greedy]
        probs = None
        if random_rows:
            reqs = [rows[i] for i in random_rows]
            sub = filter_logits(logits[random_rows], reqs, self.sampler.filter_kernels)
            probs = dict(zip(random_rows, torch.softmax(sub, dim=-1), strict=True))
        emitted_rows, emitted_tokens, counts = [], [], []
        for i, req in enumerate(requests):
            lo, k = starts[i], num_spec[i]
            if req.sampling_params.is_greedy:
                toks = self._greedy(req.spec_token_ids[:k], argmax[lo : lo + k + 1])
            else:
                toks = self._rejection(req, k, [probs[lo + j] for j in range(k + 1)])
            emitted_rows.extend(range(lo, lo + len(toks)))
            emitted_tokens.extend(toks)
            counts.append(len(toks))
        sampled = build_sampled_tokens(
            torch.tensor(emitted_tokens, device=logits.device),
            None if raw_logprobs is None else raw_logprobs[emitted_rows],
            [rows[r] for r in emitted_rows],
        )
        out, pos = [], 0
        for n in counts:
            out.append(sampled[pos : pos + n])
            pos += n
        return out

    @staticmethod
    def _greedy(drafts: list[int], argmax: list[int]) -> list[int]:
        a = 0
        while a < len(drafts) and drafts[a] == argmax[a]:
            a += 1
        return drafts[:a] + [argmax[a]]

    def _rejection(self, req: Request, k: int, p: list[torch.Tensor]) -> list[int]:
        drafts = req.spec_token_ids[:k]
        q = req.spec_draft_probs
        device = p[0].device
        gen = self.sampler.generator(req, req.num_output_tokens, device, VERIFY_SALT)
        accepted = 0
        if k:
            p_d = torch.stack([p[j][drafts[j]] for j in range(k)])  # [k]
            d_idx = torch.tensor(drafts, device=device)
            q_d = (
                torch.ones(k, device=device) if q is None else q[:k].gather(1, d_idx[:, None])[:, 0]
            )
            u = torch.rand(k, device=device, generator=gen)
            ok = (u * q_d <= p_d).tolist()
            while accepted < k and ok[accepted]:
                accepted += 1
        if accepted < k:  # resample from the residual max(p - q, 0)
            residual = p[accepted].clone()
            if q is None:
                residual[drafts[accepted]] = 0.0
            else:
                residual = (residual - q[accepted]).clamp_min_(0.0)
            target = residual if float(residual.sum()) > 0 else p[accepted]
        else:
            target = p[k]
        token = sample_probs(target.unsqueeze(0), [gen])[0]
        return drafts[:accepted] + [token]

    def _grammar_masks(
        self, logits: torch.Tensor, requests: list[Request], num_spec: list[int], starts: list[int]
    ) -> None:
        """Row ``j`` of a structured-output request gets the mask of its grammar after the
        drafts ``d_1..d_j`` (the matcher steps through them and is rolled back)."""
        vocab = logits.shape[1]
        for i, req in enumerate(requests):
            if req.grammar is None:
                continue
            k = num_spec[i]
            bitmask = torch.zeros(k + 1, (vocab + 31) // 32, dtype=torch.int32)
            consumed = 0
            for j in range(k + 1):
                req.grammar.unsafe_compute_mask_ptr(bitmask[j].data_ptr(), bitmask.shape[1] * 4)
                if j == k or not req.grammar.consume_token(req.spec_token_ids[j]):
                    # Rows past a draft the grammar refuses are never used (row j rejects
                    # it); leave them unmasked so they stay finite.
                    bitmask[j + 1 :] = -1
                    break
                consumed += 1
            if consumed:
                req.grammar.rollback(consumed)
            allowed = bitmask_to_bool(bitmask, vocab).to(logits.device)
            block = logits[starts[i] : starts[i + 1]]
            block.masked_fill_(~allowed, float("-inf"))
