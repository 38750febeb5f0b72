"""The model runner: turns a ``SchedulerOutput`` into tensors, runs the model over the flat
batch, and returns the logits of the tokens that need sampling."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from fastforward.attention.metadata import AttentionMetadata, GroupMetadata
from fastforward.heap import trim_heap
from fastforward.huge_pages import (
    HugePageTensors,
    gather_weights,
    huge_page_zeros,
    huge_pages_supported,
)
from fastforward.kernels.decoder import build_fused_decoder
from fastforward.kv.quant import allocate_kv_cache, kv_cache_layout
from fastforward.kv.spec import KVCacheConfig
from fastforward.layers.greedy_screen import GreedyScreen, build_greedy_screen
from fastforward.layers.logprobs import TokenLogprob, score_positions
from fastforward.layers.sampler import plain_greedy
from fastforward.request import Request
from fastforward.scheduler_output import SchedulerOutput


@dataclass(slots=True)
class BatchInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # [S] rows of the flat batch whose next token is sampled: one per request, 1 + k for a
    # request verifying k draft tokens
    logits_indices: torch.Tensor
    sample_requests: list[Request]
    num_spec: list[int]  # drafts verified by each sample request
    prompt_scoring: list[PromptScoring] = field(default_factory=list)


@dataclass(slots=True)
class PromptScoring:
    """Rows ``rows`` of the flat batch predict prompt tokens ``targets`` of ``request``."""

    request: Request
    rows: list[int]
    targets: list[int]


@dataclass(slots=True)
class StepResult:
    # [S, vocab] float32; None where the greedy screen picked every token (``tokens``)
    logits: torch.Tensor | None
    # Rows of logits in request order: 1 + num_spec[i] rows belong to requests[i].
    requests: list[Request]
    num_spec: list[int]
    # request id -> logprobs of the prompt tokens this step scored (prompt_logprobs requests)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # [S] int64: each request's token, where the greedy screen picked them (execute's
    # screen_greedy): the argmax of the logits it did not compute
    tokens: torch.Tensor | None = None


def _no_huge_pages(device: torch.device) -> str:
    """Why tensors on ``device`` cannot go into huge pages here ("" where they can)."""
    if device.type != "cpu":
        return f"tensors on {device.type}, huge pages are for CPU memory"
    if not huge_pages_supported():
        return "this OS has no transparent huge pages"
    return ""


def _gather_weights(model: nn.Module, device: torch.device) -> tuple[HugePageTensors | None, str]:
    """``gather_weights`` where it applies: (what moved, "") or (None, why not)."""
    if reason := _no_huge_pages(device):
        return None, reason
    try:
        return gather_weights(model), ""
    except OSError as e:  # the advice refused: the weights stay where they are
        return None, f"MADV_HUGEPAGE failed: {e}"


def _allocate_kv_slots(
    shape: tuple[int, ...], dtype: torch.dtype, num_slots: int, device: torch.device, huge: bool
) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None]], HugePageTensors | None, str]:
    """Each KV slot's (cache, scales or None), zeroed, and where they are: in one huge-page
    buffer (what was placed, "") or from PyTorch's allocator (None, why). Decode attention
    reads each sequence's blocks wherever the pool put them, a new page every block or two:
    in 2 MiB pages those reads miss the TLB far less (decode attention 5-10% faster a layer,
    docs/cpu.md)."""
    layout = kv_cache_layout(shape, dtype)
    reason = _no_huge_pages(device) if huge else "huge_pages=False"
    if not reason:
        try:
            tensors, placed = huge_page_zeros(layout * num_slots)
        except OSError as e:
            reason = f"MADV_HUGEPAGE failed: {e}"
        else:
            n = len(layout)  # (cache, scales) or (cache,) a slot
            scales = tensors[1::n] if n > 1 else [None] * num_slots
            return list(zip(tensors[::n], scales, strict=True)), placed, ""
    return [allocate_kv_cache(shape, dtype, device) for _ in range(num_slots)], None, reason


class ModelRunner:
    """Owns the KV cache tensors and runs forward passes. One tensor per KV slot, shared by
    one layer of every group: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` of the
    groups' KV dtype (plus ``[2, num_blocks, block_size, num_kv_heads]`` scales if int8)."""

    def __init__(
        self,
        model: nn.Module,
        kv_config: KVCacheConfig,
        device: torch.device,
        fused_layers: bool = True,
        huge_pages: bool = True,
        greedy_screen: bool = True,
    ) -> None:
        self.model = model
        # The weights in 2 MiB pages (huge_pages.py), before anything keeps references to them
        self.huge_pages, self.huge_pages_reason = None, "huge_pages=False"
        if huge_pages:
            self.huge_pages, self.huge_pages_reason = _gather_weights(model, device)
        # Plain greedy steps of a few rows read an int8 copy of the output projection
        # (layers/greedy_screen.py; ``greedy_screen_reason`` says why there is none): built
        # before the KV cache is touched, so its temporaries do not add to the peak, and in 2
        # MiB pages where the weights are (single-stream decode 2-4% faster than in 4 KiB ones)
        self.greedy_screen: GreedyScreen | None = None
        self.greedy_screen_reason = "greedy_screen=False"
        if greedy_screen:
            self.greedy_screen, self.greedy_screen_reason = build_greedy_screen(model)
            if self.greedy_screen is not None and self.huge_pages is not None:
                _gather_weights(self.greedy_screen, device)
        self.kv_config = kv_config
        self.device = device
        spec = kv_config.groups[0].spec
        shape = (2, kv_config.num_blocks, kv_config.block_size, spec.num_kv_heads, spec.head_dim)
        trim_heap()  # the weights' copies freed by the gather, before the cache is touched
        # a quantized cache keeps one scale per (token, head) vector beside each slot tensor
        slots, self.kv_huge_pages, self.kv_huge_pages_reason = _allocate_kv_slots(
            shape, spec.dtype, kv_config.num_slots, device, huge_pages
        )
        self.kv_caches = [cache for cache, _ in slots]
        self.kv_scales = [scales for _, scales in slots]
        self._bind_kv_caches()
        # Decode-sized steps through all layers in one C++ call (kernels/decoder.py), where
        # the model is on the native kernels; ``fused_reason`` says why not otherwise.
        self.fused_reason = "fused_layers=False"
        if fused_layers and hasattr(model, "fused_decoder"):
            model.fused_decoder, self.fused_reason = build_fused_decoder(model)

    def _bind_kv_caches(self) -> None:
        layers = self.model.attention_layers()
        for idx, attn in enumerate(layers):
            group, slot = self.kv_config.layer_location(idx)
            attn.kv_cache = self.kv_caches[slot]
            attn.kv_scales = self.kv_scales[slot]
            attn.group = group

    def prepare(self, sched: SchedulerOutput) -> BatchInputs:
        """Flatten the scheduled chunks of all requests into one batch."""
        starts = np.array([s.start for s in sched.scheduled], dtype=np.int64)
        lens = np.array([s.num_new_tokens for s in sched.scheduled], dtype=np.int64)
        tokens = np.concatenate([s.token_ids for s in sched.scheduled])
        seq_of_token = np.repeat(np.arange(len(lens)), lens)
        query_start = np.concatenate([[0], np.cumsum(lens)])
        positions = starts[seq_of_token] + (np.arange(len(tokens)) - query_start[seq_of_token])
        seq_lens = starts + lens
        groups = [
            self._group_metadata(sched, g, seq_of_token, positions)
            for g in range(len(self.kv_config.groups))
        ]
        to = self._tensor
        meta = AttentionMetadata(
            query_start_loc=to(query_start),
            query_lens=to(lens),
            seq_lens=to(seq_lens),
            max_query_len=int(lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=self.kv_config.block_size,
            groups=groups,
        )
        sample_rows = [i for i, s in enumerate(sched.scheduled) if s.sample]
        num_spec = [sched.scheduled[i].num_spec_tokens for i in sample_rows]
        ends = query_start[1:][sample_rows]
        if any(num_spec):
            logits_rows = np.concatenate(
                [np.arange(end - 1 - k, end) for end, k in zip(ends, num_spec, strict=True)]
            )
        else:
            logits_rows = ends - 1
        return BatchInputs(
            input_ids=to(tokens),
            positions=to(positions),
            meta=meta,
            logits_indices=to(logits_rows),
            sample_requests=[sched.scheduled[i].request for i in sample_rows],
            num_spec=num_spec,
            prompt_scoring=_prompt_scoring(sched, query_start),
        )

    def _group_metadata(
        self, sched: SchedulerOutput, group: int, seq_of_token: np.ndarray, positions: np.ndarray
    ) -> GroupMetadata:
        tables = [s.block_ids[group] for s in sched.scheduled]
        width = max(len(t) for t in tables)
        table = np.zeros((len(tables), width), dtype=np.int64)  # padded with null block 0
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        bs = self.kv_config.block_size
        slots = table[seq_of_token, positions // bs] * bs + positions % bs
        return GroupMetadata(block_tables=self._tensor(table), slot_mapping=self._tensor(slots))

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device)

    @torch.inference_mode()
    def execute(
        self,
        sched: SchedulerOutput,
        layer_ids: Sequence[int] | None = None,
        screen_greedy: bool = False,
    ) -> StepResult:
        """One forward pass over the scheduled tokens; ``layer_ids`` runs only those layers
        (a self-speculative draft). ``screen_greedy``: the caller takes ``StepResult.tokens``
        in place of logits where every request's token is a plain greedy pick
        (``sampler.plain_greedy``) and the greedy screen takes the step."""
        batch = self.prepare(sched)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, layer_ids)
        rows = hidden[batch.logits_indices]
        tokens = self._screened(rows, batch) if screen_greedy else None
        logits = None if tokens is not None else self.model.compute_logits(rows).float()
        prompt_lps = {}
        for ps in batch.prompt_scoring:
            rows = hidden[torch.tensor(ps.rows, device=hidden.device)]
            prompt_lps[ps.request.request_id] = score_positions(
                self.model.compute_logits,
                rows,
                ps.targets,
                ps.request.sampling_params.prompt_logprobs,
            )
        return StepResult(logits, batch.sample_requests, batch.num_spec, prompt_lps, tokens)

    def _screened(self, rows: torch.Tensor, batch: BatchInputs) -> torch.Tensor | None:
        """The greedy screen's tokens for the step's rows, or None where it does not take them
        (a request that is no plain greedy pick, drafts to verify, too many rows, or a row the
        screen leaves to the full projection)."""
        screen = self.greedy_screen
        if (
            screen is None
            or not screen.takes(rows.shape[0])
            or any(batch.num_spec)
            or not all(plain_greedy(r) for r in batch.sample_requests)
        ):
            return None
        return screen(rows, self.model.lm_head.tiles)


def _prompt_scoring(sched: SchedulerOutput, query_start: np.ndarray) -> list[PromptScoring]:
    """Which rows score which prompt tokens: position ``j`` predicts prompt token ``j + 1``, for
    the positions of this chunk not scored before (a preempted request is not scored twice)."""
    out = []
    for i, s in enumerate(sched.scheduled):
        req = s.request
        if not req.needs_prompt_logprobs:
            continue
        lo = max(s.start, len(req.prompt_logprobs))
        hi = min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1)
        if lo < hi:
            rows = [int(query_start[i]) + j - s.start for j in range(lo, hi)]
            out.append(PromptScoring(req, rows, req.prompt_token_ids[lo + 1 : hi + 1]))
    return out
