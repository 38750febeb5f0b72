"""The attention front-end every model uses: stores new K/V into the paged cache, then asks the
backend for attention over the whole cached context."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastforward.attention.metadata import AttentionMetadata, split_by_query_len
from fastforward.attention.reference import paged_attention, write_kv
from fastforward.kv.quant import dequantize

# Steps whose longest query run is at most this many tokens (decode, small chunks) use the
# native kernel. Longer prefills do too where bf16 queries meet a bf16 cache on a CPU with
# AVX512-BF16 (the kernel's vdpbf16ps path: a 512-token prefill of SmolLM2 ran at ~2,300 tok/s
# against ~1,900 with SDPA); otherwise they go to the reference path, whose SDPA beats the
# kernel's fp32 scoring there.
KERNEL_MAX_QUERY_LEN = 16


def blocks_read(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks the sequences' keys fill, in table order (a block two sequences share comes
    twice), and the block tables renumbered to index that list."""
    device = block_tables.device
    used = (
        torch.arange(block_tables.shape[1], device=device) < (-(-seq_lens // block_size))[:, None]
    )
    blocks = block_tables[used]
    renumbered = torch.zeros_like(block_tables)
    renumbered[used] = torch.arange(blocks.numel(), device=device)
    return blocks, renumbered


class Attention(nn.Module):
    """Paged causal attention of one layer. The runner binds ``kv_cache`` (this layer's slot
    tensor ``[2, num_blocks, block_size, KVH, D]``), ``kv_scales`` (its scales when the cache is
    int8) and ``group`` (its KV cache group)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        rotary_dim: int = 0,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None  # [2, num_blocks, block_size, KVH] if int8
        # RoPE rotates channel pairs (i, i + rotary_dim / 2) of the first rotary_dim channels
        self.rotary_dim = rotary_dim
        # Per-channel key scale m (kv/calibrate.py): keys are stored as k / m and queries read
        # them as q * m, which leaves every q.k unchanged while an int8 cache's per-token scale
        # no longer has to span a few outlier channels. None: off.
        self.key_mult: torch.Tensor | None = None  # [KVH, D] fp32, 1 / m
        self.query_mult: torch.Tensor | None = None  # [H, D] fp32, m of each head's KV head
        self.calibrating = False  # record key_absmax over the keys this layer sees
        self.key_absmax: torch.Tensor | None = None
        self.group = 0
        # fastforward's C++ paged attention (fastforward.kernels) instead of the reference
        self.use_kernel = False
        # the kernel's bf16 path (AVX512-BF16) also takes long query runs (prefill)
        self.kernel_long_queries = False
        # so does its int8-cache path (AVX512-VNNI), for queries of any dtype
        self.kernel_long_queries_int8 = False
        # prompt chunks in one call: bf16 ones on AMX tiles (paged_prefill_attention_amx,
        # AMX CPUs), else bf16 or float32 ones on AVX-512 FMAs (paged_prefill_attention)
        self.kernel_prompts_amx = False
        self.kernel_prompts_f32 = False

    def set_key_channel_scale(self, m: torch.Tensor | None) -> None:
        """Use per-channel key scale ``m [KVH, D]`` (equal within each RoPE pair), or none."""
        if m is None:
            self.key_mult = self.query_mult = None
            return
        if m.shape != (self.num_kv_heads, self.head_dim) or not bool((m > 0).all()):
            raise ValueError(f"key channel scale must be positive [KVH, D], got {tuple(m.shape)}")
        groups = self.num_heads // self.num_kv_heads
        self.key_mult = (1.0 / m).float()
        self.query_mult = m.float().repeat_interleave(groups, dim=0)

    def takes_long_queries(self, q_dtype: torch.dtype) -> bool:
        """Whether the kernel serves query runs of any length for queries of ``q_dtype``. Not an
        int8 cache's prompt chunks where a prompt kernel takes them dequantized, faster
        (``prompts_dequantized``; figures in ``forward``)."""
        cache = self.kv_cache
        if cache is not None and cache.dtype == torch.int8:
            return self.kernel_long_queries_int8 and not self.prompts_dequantized(q_dtype)
        return (
            self.kernel_long_queries
            and q_dtype == torch.bfloat16
            and cache is not None
            and cache.dtype == torch.bfloat16
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q ``[T, H, D]``, k and v ``[T, KVH, D]`` -> ``[T, H * D]``."""
        if self.kv_cache is None:
            raise RuntimeError("attention layer has no KV cache bound (runner not initialised)")
        group = meta.groups[self.group]
        if self.calibrating:
            seen = k.detach().float().abs().amax(0)
            self.key_absmax = seen if self.key_absmax is None else self.key_absmax.maximum(seen)
        dtype = q.dtype
        if self.key_mult is not None:  # in fp32: the bf16 rounding of q * m would add error
            q, k, v = q.float() * self.query_mult, k.float() * self.key_mult, v.float()
        if self.use_kernel:
            torch.ops.fastforward.write_kv(self.kv_cache, k, v, group.slot_mapping, self.kv_scales)
        else:
            write_kv(self.kv_cache, k, v, group.slot_mapping, self.kv_scales)
        if not self.use_kernel:
            out = self._reference(q, meta)
        elif meta.max_query_len <= KERNEL_MAX_QUERY_LEN:
            out = self._kernel(q, meta)
        elif self.prompts_split(dtype):
            # prompt chunks on a prompt kernel in the model's dtype, decode rows of the same step
            # on the kernel. Over an int8 cache the blocks they read dequantized (a fresh
            # 512-token prompt of SmolLM2's heads: 1.95 ms a layer on AVX-512 FMAs against 4.2
            # on paged_attention's vpdpwssd path, 7.2 on its generic one; AMX tiles where the
            # CPU has them); over a bf16 cache the cache as it is (the AMD EPYC, AVX512-BF16:
            # 1.75 ms a layer against 3.55 on paged_attention's vdpbf16ps path)
            out = self._mixed(q, k, meta, prompts_dtype=dtype)
        elif self.takes_long_queries(q.dtype):
            out = self._kernel(q, meta)
        elif self._one_prompt(k, meta):
            out = self._prompt(q, k, v, meta)
        else:
            out = self._mixed(q, k, meta)
        return out.flatten(1).to(dtype)

    def _one_prompt(self, k: torch.Tensor, meta: AttentionMetadata) -> bool:
        """One sequence whose attention is plain causal (``_plain_causal``)."""
        return meta.num_seqs == 1 and self._plain_causal(k)

    def _plain_causal(self, k: torch.Tensor) -> bool:
        """Plain causal attention over a float cache of the keys' dtype: the new keys and
        values in the cache are exactly this step's k and v."""
        return (
            self.sliding_window is None
            and self.softcap is None
            and self.kv_scales is None
            and self.kv_cache.dtype == k.dtype
        )

    def prompts_on_amx(self, dtype: torch.dtype) -> bool:
        return self.kernel_prompts_amx and dtype == torch.bfloat16

    def _prompts_on_kernel(self, dtype: torch.dtype, k: torch.Tensor) -> bool:
        """Whether this step's prompt chunks go to ``_prompts_kernel`` with queries of
        ``dtype``: causal attention with no window or softcap over a cache of the keys' dtype
        (``_plain_causal``) or an int8 one (read dequantized: ``_prompt_cache``), bf16 on an AMX
        CPU, or bf16 or float32 where the CPU has AVX-512."""
        if self.kv_scales is not None:
            return self.prompts_dequantized(dtype)
        return self._prompt_kernel_for(dtype) and self._plain_causal(k)

    def _prompt_kernel_for(self, dtype: torch.dtype) -> bool:
        return self.prompts_on_amx(dtype) or (
            self.kernel_prompts_f32 and dtype in (torch.bfloat16, torch.float32)
        )

    def prompts_split(self, dtype: torch.dtype) -> bool:
        """Whether a step's prompt chunks, with queries of ``dtype``, go to a prompt kernel
        and its short runs to the kernel (``_mixed``), ahead of the routes after it: an int8
        cache's over their blocks dequantized (``prompts_dequantized``), or a float cache's as
        it is where the kernel's long-query path would take them (``prompts_in_place``). The
        fused stack hands its steps of prompt chunks only to the same kernel
        (``build_fused_decoder``)."""
        return self.prompts_dequantized(dtype) or (
            self.takes_long_queries(dtype) and self.prompts_in_place(dtype)
        )

    def prompts_in_place(self, dtype: torch.dtype) -> bool:
        """Whether prompt chunks (query runs over ``KERNEL_MAX_QUERY_LEN`` tokens) with queries
        of ``dtype`` go to a prompt kernel over this layer's float cache as it is (plain causal
        attention over a cache of that dtype, no key scale), where the kernel's long-query path
        would otherwise take them (``takes_long_queries``); decode rows of the same step stay
        on the kernel (``_mixed``)."""
        return (
            self.kv_scales is None
            and self.key_mult is None
            and self._prompt_kernel_for(dtype)
            and self.sliding_window is None
            and self.softcap is None
            and self.kv_cache is not None
            and self.kv_cache.dtype == dtype
        )

    def prompts_dequantized(self, dtype: torch.dtype) -> bool:
        """Whether an int8 cache's prompt chunks go to a prompt kernel with queries of
        ``dtype``, over their blocks dequantized (``_prompt_cache``)."""
        return (
            self.kv_scales is not None
            and self._prompt_kernel_for(dtype)
            and self.sliding_window is None
            and self.softcap is None
        )

    def _prompts_kernel(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's prompt chunks in one call, on AMX tiles (csrc/attention_amx.cpp) or on
        AVX-512 FMAs (csrc/attention_prompt.cpp): each sequence's queries over its keys, its
        cached context and its own new ones, read from the cache (this step's were just
        written)."""
        ops = torch.ops.fastforward
        op = (
            ops.paged_prefill_attention_amx
            if self.prompts_on_amx(q.dtype)
            else ops.paged_prefill_attention
        )
        cache, block_tables = self._prompt_cache(q.dtype, meta)
        return op(q, cache, block_tables, meta.query_start_loc, meta.seq_lens, self.scale)

    def _prompt_cache(
        self, dtype: torch.dtype, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache and block tables the prompt kernels read: this layer's own, or where the
        cache is int8 the blocks the sequences read dequantized (as the reference path does,
        then rounded to ``dtype``) into a cache of their own, the tables renumbered to it."""
        tables = meta.groups[self.group].block_tables
        if self.kv_scales is None:
            return self.kv_cache, tables
        block_size = self.kv_cache.shape[2]
        blocks, renumbered = meta.cached(
            ("blocks read", self.group), lambda: blocks_read(tables, meta.seq_lens, block_size)
        )
        return dequantize(self.kv_cache[:, blocks], self.kv_scales[:, blocks], dtype), renumbered

    def _prompt(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """One prompt (or prompt chunk) on the step's own q, k, v (and the cached context's
        keys and values), without the reference path's gathers, mask and scatter of the
        output."""
        if self._prompts_on_kernel(q.dtype, k):
            # AMX tiles: 1.6-2x PyTorch's flash attention on fresh prompts, ~2x over a long
            # context; AVX-512 FMAs (no AMX, no AVX512-BF16): ~2.4x on a fresh 512-token prompt
            return self._prompts_kernel(q, meta)
        context = int(meta.seq_lens[0]) - q.shape[0]
        qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, heads, T, D]
        if context == 0:
            # SDPA's causal mode (a 512-token prefill ~3,730 -> ~4,180 tok/s)
            out = F.scaled_dot_product_attention(
                qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=True
            )
            return out[0].transpose(0, 1)
        # The cached keys (all visible) and the new ones (causal) through PyTorch's CPU flash
        # kernel separately, the two softmaxes merged by their log-sum-exps: the explicit mask
        # made it compute the blocks above the diagonal too (1,952 queries over 4,000 keys,
        # SmolLM2's heads: 36.8 -> 28.5 ms a layer).
        groups = self.num_heads // self.num_kv_heads
        cached = [x.transpose(0, 1)[None] for x in self._cached(meta, context)]  # [1, KVH, ctx, D]
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        old, lse_old = flash(
            qh,
            *(x.repeat_interleave(groups, dim=1) for x in cached),
            0.0,
            False,
            scale=self.scale,
        )
        new, lse_new = flash(
            qh,
            *(x.repeat_interleave(groups, dim=1) for x in (kh, vh)),
            0.0,
            True,
            scale=self.scale,
        )
        lse = torch.logaddexp(lse_old, lse_new)
        out = old.float() * (lse_old - lse).exp()[..., None]
        out += new.float() * (lse_new - lse).exp()[..., None]
        return out[0].transpose(0, 1).to(q.dtype)

    def _cached(self, meta: AttentionMetadata, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The one sequence's first ``context`` keys and values from the cache, [ctx, KVH, D]."""
        block = self.kv_cache.shape[2]
        blocks = meta.groups[self.group].block_tables[0, : -(-context // block)]
        k, v = (self.kv_cache[i][blocks].flatten(0, 1)[:context] for i in range(2))
        return k, v

    def _kernel(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        group = meta.groups[self.group]
        return torch.ops.fastforward.paged_attention(
            q.contiguous(),
            self.kv_cache,
            group.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            self.scale,
            self.sliding_window or 0,
            self.softcap or 0.0,
            self.kv_scales,
        )

    def _reference(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return paged_attention(
            q,
            self.kv_cache,
            meta,
            meta.groups[self.group],
            scale=self.scale,
            window=self.sliding_window,
            softcap=self.softcap,
            kv_scales=self.kv_scales,
        )

    def _mixed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        meta: AttentionMetadata,
        prompts_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Long query runs (prefill chunks) in one call of a prompt kernel where the CPU has one
        (their queries in ``prompts_dtype``, else q's), else through the reference path's SDPA;
        the short ones (decode rows of the same step) through the kernel: padding a decode row
        to the longest prefill chunk in SDPA's ``[B, max_q]`` layout would cost a whole chunk of
        queries. (``k``: the step's keys, for ``_prompts_on_kernel``.)"""
        prompts_dtype = prompts_dtype or q.dtype
        prompts = self._prompts_on_kernel(prompts_dtype, k)
        split = meta.cached(
            "split_by_query_len", lambda: split_by_query_len(meta, KERNEL_MAX_QUERY_LEN)
        )
        if split is None:
            if prompts:
                return self._prompts_kernel(q.to(prompts_dtype), meta)
            return self._reference(q, meta)
        short, long = split
        out = torch.empty_like(q)
        out[short.rows] = self._kernel(q[short.rows], short.meta)
        if prompts:
            out[long.rows] = self._prompts_kernel(q[long.rows].to(prompts_dtype), long.meta).to(
                q.dtype
            )
        else:
            out[long.rows] = self._reference(q[long.rows], long.meta)
        return out
