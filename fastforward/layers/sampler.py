"""Batched next-token sampling: penalties, temperature, min-p / top-k / top-p, seeds, logprobs.

One vectorized pass over the batch. Per-request settings become per-row parameter tensors; the
only per-request Python work is turning token lists into tensors (penalties, min_tokens) and
creating one ``torch.Generator`` per *seeded* row.

Order of operations (vLLM v1):

0. Structured-output rows: ``-inf`` for the tokens their grammar forbids.
1. ``raw_logprobs = log_softmax(logits)`` when any row asks for logprobs (model logits, after
   the grammar mask).
2. Repetition penalty (prompt + output tokens), then frequency and presence penalties (output
   tokens only), then DRY (tokens that would extend a repeated sequence, ``dry.py``).
3. ``min_tokens``: EOS and ``stop_token_ids`` get ``-inf`` while fewer tokens were generated.
4. Greedy rows (temperature ~ 0) take the argmax here and consume no randomness.
5. Other rows: divide by temperature, mask with min-p, then top-k, then top-p (top-p sees the
   distribution renormalized after min-p and top-k), and sample from ``softmax`` of the result
   by inverse CDF: one uniform ``u`` a row, the first token whose running probability passes
   ``u`` (vLLM's exponential race ``argmax(probs / E)`` draws an ``E ~ Exp(1)`` a token, which
   torch's CPU generator does serially: 61-68 ms a step at 64 rows of a 49k vocabulary).

Seeded rows draw ``u`` from a generator seeded from ``(seed, num_output_tokens)``, so the token
depends only on the request, never on its batch row or neighbours, and recomputing a step after
preemption gives the same token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fastforward.layers.dry import DryPenalty
from fastforward.request import Request
from fastforward.sampling_params import SamplingParams
from fastforward.structured_outputs import GrammarCompiler, apply_grammar_masks

# Temperatures below this are treated as greedy (dividing by them would overflow); as vLLM.
_GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class FilterKernels:
    """C++ twins of the filters' steps over fp32 CPU logits [R, V] (``fastforward.kernels``'
    ops), for :func:`filter_logits`."""

    # top-p in place with top_p [R]; returns which rows it took (``top_p_filter_``)
    top_p: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # -inf in place where logits < threshold [R] (``mask_below_``): min-p and top-k
    mask_below: Callable[[torch.Tensor, torch.Tensor], None]

    @classmethod
    def from_ops(cls, ops) -> FilterKernels:
        return cls(top_p=ops.top_p_filter_, mask_below=ops.mask_below_)

    def take(self, logits: torch.Tensor) -> bool:
        """Whether these kernels take ``logits`` (fp32, CPU, contiguous)."""
        return (
            logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.is_contiguous()
        )


@dataclass(slots=True)
class SampledToken:
    """The token picked for one request, with its logprobs when the request asked for them."""

    token_id: int
    logprob: float | None = None  # of the sampled token, from the raw model logits
    top_logprobs: list[tuple[int, float, int]] | None = None  # (token_id, logprob, rank 1-based)
    rank: int | None = None  # of the sampled token: 1 + number of tokens with a greater logprob


def _splitmix64(x: int) -> int:
    """A well-mixed 64-bit hash (low bits matter: the CPU generator keeps only 32 of them)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """Seed of the generator a seeded request uses for its ``step``-th generated token."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))


class Sampler:
    """Picks one token per row of a ``[B, V]`` logits tensor; row ``i`` belongs to
    ``requests[i]``. ``seed`` seeds the generator shared by unseeded rows."""

    def __init__(
        self,
        seed: int | None = None,
        grammars: GrammarCompiler | None = None,
        token_texts: Callable[[], Sequence[str]] | None = None,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
        sample_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        filter_kernels: FilterKernels | None = None,
    ) -> None:
        """``argmax``: each row's first maximum (first NaN) of fp32 CPU logits, e.g. the C++
        ``argmax_rows``; None takes ``max(dim=-1).indices``. ``sample_logits``: each row's
        token for its uniform from ``softmax`` of fp32 CPU logits by inverse CDF (-1: the row
        has no finite positive mass), e.g. the C++ ``sample_logits``; None takes
        :func:`inverse_cdf` of the softmax. ``filter_kernels``: min-p, top-k and top-p over
        fp32 CPU logits in C++ (:func:`filter_logits`); None: torch ops."""
        self._base_seed = seed
        self.filter_kernels = filter_kernels
        self._argmax = argmax
        self._sample_logits = sample_logits
        self._grammars = grammars
        # DRY's sequence breakers are found in the vocabulary's texts (layers/dry.py)
        self.dry = DryPenalty(token_texts)
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self, logits: torch.Tensor, requests: list[Request], *, owned: bool = False
    ) -> list[SampledToken]:
        """``owned``: the caller hands ``logits`` over (it does not read them afterwards), so
        fp32 ones are processed in place instead of copied first."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(
                f"logits must be [len(requests), V], got {tuple(logits.shape)} "
                f"for {len(requests)} requests"
            )
        if not requests:
            return []
        params = [r.sampling_params for r in requests]
        # (an inference tensor, as the runner's, takes in-place updates in inference mode only)
        writable = not logits.is_inference() or torch.is_inference_mode_enabled()
        if not (owned and writable and logits.dtype == torch.float32):
            logits = logits.to(torch.float32, copy=True)  # [B, V]; processed in place below
        if self._grammars is not None:
            apply_grammar_masks(logits, requests, self._grammars)

        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]

        apply_penalties(logits, requests)
        self.dry(logits, requests)
        apply_min_tokens(logits, requests)

        tokens = self._sample(logits, requests)  # [B] int64
        return build_sampled_tokens(tokens, raw_logprobs, requests)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Greedy rows: argmax. Random rows: temperature, filters and inverse-CDF sampling.
        ``logits`` are the sampler's own (``__call__``): filtered in place when every row is
        random."""
        on_kernel = logits.dtype == torch.float32 and logits.device.type == "cpu"
        temps = [r.sampling_params.temperature for r in requests]
        rows = [i for i, t in enumerate(temps) if t >= _GREEDY_EPS]
        if len(rows) < len(requests):
            # max's indices: the same first-maximum (and NaN) picks as argmax, 2-2.5x faster on
            # the CPU over a [64, 49k] fp32 batch (1.1 against 2.6 ms, 2 threads); the kernel
            # another ~3x (0.85 -> 0.25 ms, AMX Xeon)
            if self._argmax is not None and on_kernel:
                tokens = self._argmax(logits)  # [B]
            else:
                tokens = logits.max(dim=-1).indices
        else:
            tokens = torch.empty(len(requests), dtype=torch.int64, device=logits.device)
        if not rows:
            return tokens
        device = logits.device
        rand_reqs = [requests[i] for i in rows]
        row_idx = torch.tensor(rows, device=device)  # [R]
        sub = logits if len(rows) == len(requests) else logits.index_select(0, row_idx)
        sub = filter_logits(sub, rand_reqs, self.filter_kernels)  # [R, V]
        u = self._uniforms(rand_reqs, device)  # [R]
        if self._sample_logits is not None and on_kernel:
            picked = self._sample_logits(sub, u)
        else:
            picked = inverse_cdf(torch.softmax(sub, dim=-1), u)
        no_mass = picked < 0
        if bool(no_mass.any()):  # NaN logits: the first NaN of the probabilities, as argmax
            picked = torch.where(no_mass, torch.softmax(sub, dim=-1).argmax(dim=-1), picked)
        tokens[row_idx] = picked
        return tokens

    def _uniforms(self, requests: list[Request], device: torch.device) -> torch.Tensor:
        """``[R]`` float64 uniforms in [0, 1): seeded rows from their own generator, the rest
        from the shared one, in row order."""
        u = torch.empty(len(requests), dtype=torch.float64, device=device)
        unseeded = [i for i, r in enumerate(requests) if r.sampling_params.seed is None]
        if unseeded:
            shared = torch.rand(
                len(unseeded),
                dtype=torch.float64,
                device=device,
                generator=self._shared_generator(device),
            )
            u[torch.tensor(unseeded, device=device)] = shared
        for i, req in enumerate(requests):
            if req.sampling_params.seed is not None:
                gen = self.generator(req, req.num_output_tokens, device)
                u[i] = torch.rand(1, dtype=torch.float64, device=device, generator=gen)[0]
        return u

    def generator(
        self, request: Request, step: int, device: torch.device, salt: int = 0
    ) -> torch.Generator | None:
        """The random stream of ``request`` at its ``step``-th generated token: its own for a
        seeded request (``salt`` separates uses within one step, e.g. drafting and verifying),
        else the shared one."""
        seed = request.sampling_params.seed
        if seed is None:
            return self._shared_generator(device)
        gen = torch.Generator(device=device)
        gen.manual_seed(step_seed(seed ^ salt, step))
        return gen

    def _shared_generator(self, device: torch.device) -> torch.Generator | None:
        """Generator for unseeded rows; ``None`` (torch's global RNG) without a base seed."""
        if self._base_seed is None:
            return None
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self._base_seed)
            self._generators[device] = gen
        return gen


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's token for its uniform ``u`` [R] (float64, in [0, 1)) from ``probs`` [R, V]:
    the first index whose running sum (float64) passes ``u`` x the row's total, so a token of
    probability 0 is never taken; -1 where the total is not finite and positive. The plain
    torch twin (any device) of the C++ ``sample_logits``, which takes the logits."""
    cum = probs.cumsum(dim=-1, dtype=torch.float64)  # [R, V]
    total = cum[:, -1]  # [R]
    picked = torch.searchsorted(cum, (u * total).unsqueeze(1), right=True).squeeze(1)
    picked = picked.clamp_(max=probs.shape[1] - 1)
    valid = torch.isfinite(total) & (total > 0)
    return torch.where(valid, picked, torch.full_like(picked, -1))


def sample_probs(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``probs`` [R, V] (weights, not necessarily normalized), row ``i``
    by inverse CDF on a uniform from ``generators[i]`` (None: torch's global one); a row
    without finite positive mass takes its argmax (first NaN). For the speculative drafter and
    verifier, which sample rows of their own generators: an Exp(1) draw a token through torch's
    serial generator cost ~1 ms a row of a 49k vocabulary."""
    u = torch.empty(probs.shape[0], dtype=torch.float64, device=probs.device)
    for i, gen in enumerate(generators):
        u[i] = torch.rand(1, dtype=torch.float64, device=probs.device, generator=gen)[0]
    picked = inverse_cdf(probs, u)
    no_mass = picked < 0
    if bool(no_mass.any()):
        picked = torch.where(no_mass, probs.argmax(dim=-1), picked)
    return picked.tolist()


# ----------------------------------------------------------------------------- logits processors


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """In place on ``logits`` [B, V]: repetition penalty over prompt + output tokens (positive
    logits divided, negative multiplied), then ``logit -= freq * count + presence * (count > 0)``
    over output tokens. Only rows with a non-neutral penalty are touched, and in them only the
    tokens they hold: the same float32 arithmetic as :func:`apply_penalties_dense` on those
    entries (the others it leaves as they are), without its [rows, vocab] counts and masks (at
    64 rows of a 49k vocabulary a repetition penalty cost 71 ms a step there)."""
    rows = _penalized_rows(requests)
    if not rows:
        return
    device, vocab = logits.device, logits.shape[1]
    rep_on = any(requests[i].sampling_params.repetition_penalty != 1.0 for i in rows)
    row_ids, tok_ids, counts = [], [], []
    for i in rows:
        req = requests[i]
        out = _in_vocab(req.output_token_ids, vocab)
        toks, cnt = np.unique(out, return_counts=True)
        if rep_on and req.sampling_params.repetition_penalty != 1.0:
            seen = np.union1d(toks, _in_vocab(req.prompt_token_ids, vocab))
            full = np.zeros(len(seen), dtype=np.int64)
            full[np.searchsorted(seen, toks)] = cnt
            toks, cnt = seen, full
        row_ids.append(np.full(len(toks), i, dtype=np.int64))
        tok_ids.append(toks)
        counts.append(cnt)
    row_idx = torch.from_numpy(np.concatenate(row_ids)).to(device)  # [N]
    tok_idx = torch.from_numpy(np.concatenate(tok_ids).astype(np.int64)).to(device)  # [N]
    if row_idx.numel() == 0:
        return
    count = torch.from_numpy(np.concatenate(counts)).to(device=device, dtype=torch.float32)
    x = logits[row_idx, tok_idx]  # [N]
    finfo = torch.finfo(torch.float32)
    if rep_on:
        rep = _param_tensor(requests, "repetition_penalty", device).clamp(min=finfo.tiny)[row_idx]
        x = torch.where(x > 0, (x / rep).clamp(max=finfo.max), x * rep)
    freq = _param_tensor(requests, "frequency_penalty", device)[row_idx]
    presence = _param_tensor(requests, "presence_penalty", device)[row_idx]
    x -= freq * count + presence * (count > 0).to(x.dtype)
    logits[row_idx, tok_idx] = x


def _penalized_rows(requests: list[Request]) -> list[int]:
    return [i for i, r in enumerate(requests) if _penalized(r.sampling_params)]


def _penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def plain_greedy(request: Request) -> bool:
    """Whether the sampler picks this request's next token as the plain argmax of the model's
    logits (``Sampler.__call__`` with nothing in its way): greedy, no logprobs, no grammar
    mask, no penalty, no DRY, and ``min_tokens`` already reached. Such a token needs only the
    argmax, not the logits (``layers/greedy_screen.py``). Keep in step with ``__call__``."""
    p = request.sampling_params
    return (
        p.temperature < _GREEDY_EPS
        and p.logprobs is None
        and request.grammar is None
        and not _penalized(p)
        and not DryPenalty.applies(p)
        and not _min_tokens_pending(request)
    )


def _min_tokens_pending(r: Request) -> bool:
    """Whether ``apply_min_tokens`` still masks the request's stop tokens."""
    return r.num_output_tokens < r.sampling_params.min_tokens


def _in_vocab(ids: Sequence[int], vocab: int) -> np.ndarray:
    """The ids inside ``[0, vocab)`` (padding or image ids outside are ignored)."""
    a = np.asarray(ids, dtype=np.int64)
    return a[(a >= 0) & (a < vocab)]


def apply_penalties_dense(logits: torch.Tensor, requests: list[Request]) -> None:
    """In place on ``logits`` [B, V]: repetition penalty over prompt + output tokens (positive
    logits divided, negative multiplied), then ``logit -= freq * count + presence * (count > 0)``
    over output tokens. Only rows with a non-neutral penalty are touched. Dense [rows, vocab]
    counts: the reference :func:`apply_penalties` is tested against."""
    rows = _penalized_rows(requests)
    if not rows:
        return
    device = logits.device
    reqs = [requests[i] for i in rows]
    row_idx = torch.tensor(rows, device=device)  # [R]
    sub = logits.index_select(0, row_idx)  # [R, V]
    counts = _token_counts(reqs, [r.output_token_ids for r in reqs], sub.shape[1], device)

    # A penalty under float32's smallest normal would be 0 here, and a masked -inf times 0 is
    # NaN (which argmax picks): clamp it, and keep the divided logits finite.
    finfo = torch.finfo(torch.float32)
    rep = _param_tensor(reqs, "repetition_penalty", device).clamp(min=finfo.tiny).unsqueeze(1)
    if bool((rep != 1.0).any()):
        prompt_counts = _token_counts(
            reqs, [r.prompt_token_ids for r in reqs], sub.shape[1], device
        )
        seen = (prompt_counts > 0) | (counts > 0)  # [R, V]
        penalized = torch.where(sub > 0, (sub / rep).clamp(max=finfo.max), sub * rep)
        sub = torch.where(seen, penalized, sub)

    freq = _param_tensor(reqs, "frequency_penalty", device).unsqueeze(1)  # [R, 1]
    presence = _param_tensor(reqs, "presence_penalty", device).unsqueeze(1)  # [R, 1]
    sub -= freq * counts + presence * (counts > 0).to(sub.dtype)
    logits[row_idx] = sub


def apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    """In place on ``logits`` [B, V]: ``-inf`` for EOS (unless ``ignore_eos``) and
    ``stop_token_ids`` in rows that generated fewer than ``min_tokens`` tokens."""
    row_ids: list[int] = []
    tok_ids: list[int] = []
    vocab = logits.shape[1]
    for i, r in enumerate(requests):
        p = r.sampling_params
        if not _min_tokens_pending(r):
            continue
        stops = set(p.stop_token_ids)
        if r.eos_token_id is not None and not p.ignore_eos:
            stops.add(r.eos_token_id)
        stops = [t for t in stops if 0 <= t < vocab]
        row_ids.extend([i] * len(stops))
        tok_ids.extend(stops)
    if row_ids:
        device = logits.device
        logits[torch.tensor(row_ids, device=device), torch.tensor(tok_ids, device=device)] = float(
            "-inf"
        )


def filter_logits(
    logits: torch.Tensor, requests: list[Request], kernels: FilterKernels | None = None
) -> torch.Tensor:
    """Temperature, then min-p, top-k, top-p, in place on ``logits`` [R, V] of non-greedy rows
    (penalties already applied). Tokens are sampled from ``softmax`` of the result.
    ``kernels``: the C++ twins of these steps, used where they take the logits."""
    device = logits.device
    logits.div_(_param_tensor(requests, "temperature", device).unsqueeze(1))
    apply_min_p(logits, _param_tensor(requests, "min_p", device), kernels)
    top_k = _top_k_tensor(requests, logits.shape[1], device)
    apply_top_k_top_p(logits, top_k, _top_p(requests, device), kernels)
    return logits


def apply_min_p(
    logits: torch.Tensor, min_p: torch.Tensor, kernels: FilterKernels | None = None
) -> None:
    """In place on ``logits`` [R, V] (already temperature-scaled): ``-inf`` where
    ``prob < min_p * max_prob``. ``min_p`` is [R]; 0 disables it for that row.

    Compared in logit space, ``logit < max_logit + ln(min_p)`` (the same rule, as
    ``exp(logit - max) < min_p``; llama.cpp's form), without the [R, V] softmax: at 64 rows of
    SmolLM2's 49,152 tokens 16.9 -> 4.3 ms (Zen 4 EPYC, 2 threads), and with ``kernels``'
    ``mask_below`` no [R, V] mask either."""
    if not bool((min_p > 0).any()):
        return
    threshold = logits.amax(dim=-1) + torch.log(min_p)  # [R]; min_p 0: -inf, nothing masked
    _mask_below(logits, threshold, kernels)


def _mask_below(
    logits: torch.Tensor, threshold: torch.Tensor, kernels: FilterKernels | None
) -> None:
    """``-inf`` in place where ``logits`` [R, V] < ``threshold`` [R]."""
    if kernels is not None and kernels.take(logits):
        kernels.mask_below(logits, threshold)
    else:
        logits.masked_fill_(logits < threshold.unsqueeze(1), float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    kernels: FilterKernels | None = None,
) -> None:
    """In place on ``logits`` [R, V]. ``top_k`` [R] (int, ``V`` = off) keeps the tokens whose
    logit is >= the k-th largest (ties kept). Then ``top_p`` [R] (float, 1.0 = off) keeps the
    smallest set of most likely tokens whose probability, renormalized after top-k and any
    earlier mask, reaches ``top_p``; the most likely token is always kept. With ``kernels``
    (where they take the logits) the C++ ``top_p_filter_`` takes every row; else each row's set
    is looked for among its most likely tokens first (:func:`_top_p_among_candidates`). Rows
    neither takes go to :func:`apply_top_k_top_p_sorted`."""
    on_kernel = kernels is not None and kernels.take(logits)
    if top_k is not None:
        _apply_top_k_only(logits, top_k, kernels)
    if top_p is None:
        return
    rows = torch.nonzero(top_p < 1.0).flatten()  # 1.0: off
    if on_kernel and rows.numel():
        whole = rows.numel() == logits.shape[0]
        sub = logits if whole else logits.index_select(0, rows)
        took = kernels.top_p(sub, top_p.index_select(0, rows))
        if not whole:
            logits[rows[took]] = sub[took]
        rows = rows[~took]
    for k in () if on_kernel else _TOP_P_CANDIDATES:
        if rows.numel() == 0:
            return
        rows = _top_p_among_candidates(logits, top_p, rows, k)
    if rows.numel():
        sub = logits.index_select(0, rows)
        apply_top_k_top_p_sorted(sub, None, top_p.index_select(0, rows))
        logits[rows] = sub


# How many of a row's most likely tokens its top-p set is looked for among, in turn, before the
# whole vocabulary is sorted: at 64 rows of a 49k vocabulary the sort took 122 ms, a top-256
# 6.5 ms (a throwaway timing on the Zen 4 EPYC, 2 threads). With the kernels the C++
# top_p_filter_ takes every row instead: SmolLM2's real logits at temperature 0.8, top_p 0.95,
# 64 rows 23.8 -> 4.5 ms, 1 row 0.43 -> 0.15; rows whose 2,048 most likely tokens hold less than
# the mass (flat: sorted) 64 rows 188 -> 4.6 ms, 1 row 6.3 -> 0.15.
_TOP_P_CANDIDATES = (256, 2048)


def _top_p_among_candidates(
    logits: torch.Tensor, top_p: torch.Tensor, rows: torch.Tensor, k: int
) -> torch.Tensor:
    """Top-p on ``rows`` (ascending) of ``logits`` [R, V] from their ``k`` most likely tokens,
    where those hold the set: the k-th is dropped, so every token outside (ties too) is.
    Writes those rows; returns the others (NaN rows among them).

    The reference's test, in float64: a token is dropped when the mass of the tokens no more
    likely than itself (it included) is at most ``1 - top_p``; that mass is the weight outside
    the candidates plus the candidates' from the least likely up, over the row's total weight
    (each ``exp(logit - max)``). Summing it from the least likely up, as the reference does,
    keeps a global rounding of the weights from moving the cut: computed as 1 minus the mass
    above, float32 softmax put 1-32 of SmolLM2's tokens on the other side of 0.95 and 0.99."""
    whole = rows.numel() == logits.shape[0]
    sub = logits if whole else logits.index_select(0, rows)  # [R', V]
    vals, idx = sub.topk(min(k, sub.shape[1]), dim=-1)  # [R', k] descending
    top = vals[:, :1]  # the row's max
    total = (sub - top).exp_().sum(dim=-1, dtype=torch.float64)  # [R']
    w = torch.exp(vals.double() - top.double())  # [R', k]
    below = (total - w.sum(dim=-1)).unsqueeze(1) + w.flip(-1).cumsum(dim=-1).flip(-1)
    limit = (1.0 - top_p.index_select(0, rows)).double().unsqueeze(1)  # as the reference
    drop = below / total.unsqueeze(1) <= limit  # [R', k]
    drop[:, 0] = False  # the most likely token stays
    held = drop[:, -1] & torch.isfinite(total)
    if k >= sub.shape[1]:
        held = torch.isfinite(total)
    kept = vals.masked_fill(drop, float("-inf"))
    if whole:  # all rows at once, then the few others put back
        rest = rows[~held]
        saved = logits.index_select(0, rest)
        logits.fill_(float("-inf")).scatter_(1, idx, kept)
        logits[rest] = saved
        return rest
    if bool(held.any()):
        done = rows[held]
        logits[done] = float("-inf")
        logits[done.unsqueeze(1), idx[held]] = kept[held]
    return rows[~held]


def apply_top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> None:
    """:func:`apply_top_k_top_p` over each row's whole vocabulary, sorted (the reference: the
    fast path is tested against it)."""
    if top_p is None:
        if top_k is not None:
            _apply_top_k_only(logits, top_k)
        return
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending, [R, V]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1).unsqueeze(1))  # [R, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)  # [R, V] ascending mass
        drop = cum <= (1.0 - top_p).unsqueeze(1)  # [R, V]
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    logits.scatter_(1, order, sorted_logits)


def _apply_top_k_only(
    logits: torch.Tensor, top_k: torch.Tensor, kernels: FilterKernels | None = None
) -> None:
    """Top-k without a full sort (much cheaper than sorting the vocabulary when k is small)."""
    vocab = logits.shape[1]
    on = top_k < vocab  # [R]
    max_k = int(top_k.masked_fill(~on, 1).max())
    top_values = logits.topk(max_k, dim=-1).values  # [R, max_k], descending
    kth = top_values.gather(1, (top_k.clamp(1, max_k) - 1).unsqueeze(1)).squeeze(1)  # [R]
    kth.masked_fill_(~on, float("-inf"))
    _mask_below(logits, kth, kernels)


# ----------------------------------------------------------------------------- helpers


def _param_tensor(requests: list[Request], name: str, device: torch.device) -> torch.Tensor:
    """[R] float32 tensor of one ``SamplingParams`` field."""
    return torch.tensor(
        [float(getattr(r.sampling_params, name)) for r in requests],
        dtype=torch.float32,
        device=device,
    )


def _top_k_tensor(requests: list[Request], vocab: int, device: torch.device) -> torch.Tensor | None:
    """[R] int64 top-k per row (``vocab`` where off), or None when no row uses top-k."""
    ks = [r.sampling_params.top_k for r in requests]
    if not any(0 < k < vocab for k in ks):
        return None
    return torch.tensor([k if 0 < k < vocab else vocab for k in ks], device=device)


def _top_p(requests: list[Request], device: torch.device) -> torch.Tensor | None:
    """[R] float32 top-p per row, or None when no row uses top-p."""
    ps = [r.sampling_params.top_p for r in requests]
    if all(p >= 1.0 for p in ps):
        return None
    return torch.tensor(ps, dtype=torch.float32, device=device)


def _token_counts(
    requests: list[Request], token_lists: list[list[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """[R, V] float32 count of each token id in each row's token list."""
    counts = torch.zeros(len(requests), vocab, dtype=torch.float32, device=device)
    lengths = [len(t) for t in token_lists]
    if sum(lengths) == 0:
        return counts
    flat = torch.tensor([t for ids in token_lists for t in ids], dtype=torch.int64)  # [N]
    rows = torch.repeat_interleave(torch.arange(len(requests)), torch.tensor(lengths))  # [N]
    keep = (flat >= 0) & (flat < vocab)  # ids outside the vocab (padding, images) are ignored
    flat, rows = flat[keep].to(device), rows[keep].to(device)
    counts.index_put_((rows, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
    return counts


def build_sampled_tokens(
    tokens: torch.Tensor, raw_logprobs: torch.Tensor | None, requests: list[Request]
) -> list[SampledToken]:
    """One ``SampledToken`` per row; logprobs (vLLM semantics) for the rows that asked."""
    token_list = tokens.tolist()
    out = [SampledToken(token_id=t) for t in token_list]
    if raw_logprobs is None:
        return out
    rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    device = raw_logprobs.device
    row_idx = torch.tensor(rows, device=device)  # [L]
    lp = raw_logprobs.index_select(0, row_idx)  # [L, V]
    sampled_lp = lp.gather(1, tokens.index_select(0, row_idx).unsqueeze(1))  # [L, 1]
    ranks = (lp > sampled_lp).sum(dim=-1) + 1  # [L]
    num_top = max(requests[i].sampling_params.logprobs for i in rows)
    top_lp, top_ids = lp.topk(min(num_top, lp.shape[1]), dim=-1)  # [L, N]
    sampled_list, rank_list = sampled_lp.squeeze(1).tolist(), ranks.tolist()
    top_lp_list, top_id_list = top_lp.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        n = requests[i].sampling_params.logprobs
        out[i].logprob = sampled_list[j]
        out[i].rank = rank_list[j]
        out[i].top_logprobs = [
            (top_id_list[j][k], top_lp_list[j][k], k + 1)
            for k in range(min(n, len(top_id_list[j])))
        ]
    return out
