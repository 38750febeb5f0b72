"""GPTQ (Frantar et al., 2022): int4 group-wise codes chosen to keep each layer's *outputs*
close on real activations, not just its weights.

Round-to-nearest makes each weight's error independently. GPTQ quantizes one input column at a
time and moves the error it just made onto the columns not yet quantized, weighted by the
inverse Hessian ``H = X^T X`` of the layer's inputs ``X`` (gathered on a calibration text), so
that ``||X W^T - X Q^T||`` rather than ``||W - Q||`` is minimized. The result is ordinary
``Int4Weights`` (same scales, zeros and kernel as ``int4``); only which codes are chosen
differs. Group scales and zeros are fitted when the quantizer reaches each group, on the
weights as updated so far (the reference implementation's ``static_groups=False``), with the
same clipping search as round-to-nearest.

Hessians come from one pass of the float model over the calibration windows (every layer sees
float inputs: the "non-sequential" variant). The output projection of a tied embedding gets
the Hessian of the final hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fastforward.quant.rtn import Int4Weights, quantize_int4_rows
from fastforward.scoring import score_tokens

GPTQ_TOKENS = 8192  # calibration tokens (``fastforward.calibration``: licences and CPython)
GPTQ_WINDOW = 512
DAMPING = 0.01  # fraction of the mean Hessian diagonal added to it (the paper's default)
BLOCK = 128  # columns updated lazily per block (a multiple of every group size)


@torch.inference_mode()
def collect_hessians(model: nn.Module, windows: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """``X^T X / n`` of every ``nn.Linear``'s input over ``windows`` (token lists), by module
    name; a tied embedding's entry (its name) holds that of the final hidden states."""
    hessians: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def accumulate(name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        if name not in hessians:
            hessians[name] = torch.zeros(x.shape[1], x.shape[1])
            counts[name] = 0
        hessians[name].addmm_(x.t(), x)
        counts[name] += x.shape[0]

    handles = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            handles.append(m.register_forward_pre_hook(lambda _m, a, n=name: accumulate(n, a[0])))
    tied = getattr(model, "lm_head", "absent") is None and isinstance(
        getattr(model, "embed_tokens", None), nn.Embedding
    )
    if tied:  # compute_logits multiplies the final norm's output by the embedding
        handles.append(
            model.norm.register_forward_hook(lambda _m, _a, out: accumulate("embed_tokens", out))
        )
    try:
        for ids in windows:
            score_tokens(model, list(ids), torch.float32)
    finally:
        for h in handles:
            h.remove()
    return {name: h / counts[name] for name, h in hessians.items()}


def gptq_int4(weight: torch.Tensor, hessian: torch.Tensor, group_size: int) -> Int4Weights:
    """Int4 group-wise codes for ``weight [N, K]`` (float) minimizing the output error under
    ``hessian [K, K]``."""
    n, k = weight.shape
    if k % group_size or BLOCK % group_size:
        raise ValueError(f"input width {k} is not a multiple of the group size {group_size}")
    w = weight.detach().float().clone()
    h = hessian.detach().double().clone()
    dead = torch.diag(h) == 0  # inputs that were always zero: their weights do not matter
    h[dead, dead] = 1
    w[:, dead] = 0
    h.diagonal().add_(DAMPING * torch.diag(h).mean())
    hinv = _upper_cholesky_of_inverse(h).float()

    codes = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, k // group_size, dtype=torch.bfloat16)
    zeros = torch.empty_like(scales)
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        wb, hb = w[:, b0:b1].clone(), hinv[b0:b1, b0:b1]
        errors = torch.empty_like(wb)
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:
                grp = col // group_size
                _, s, z = quantize_int4_rows(wb[:, i : i + group_size], group_size)
                scales[:, grp], zeros[:, grp] = s[:, 0], z[:, 0]
                sf, zf = s[:, 0].float(), z[:, 0].float()
            q = torch.round((wb[:, i] - zf) / sf + 8).clamp(0, 15)
            codes[:, col] = q.to(torch.uint8)
            err = (wb[:, i] - ((q - 8) * sf + zf)) / hb[i, i]
            wb[:, i:].sub_(err[:, None] * hb[i, i:][None, :])
            errors[:, i] = err
        w[:, b1:].sub_(errors @ hinv[b0:b1, b1:])
    return Int4Weights(codes, scales, zeros, group_size)


def _upper_cholesky_of_inverse(h: torch.Tensor) -> torch.Tensor:
    """``U`` with ``U^T U = H^-1``: row ``i`` of ``U`` from the diagonal on is how the error of
    column ``i`` spreads over the columns after it. More damping if ``H`` is not positive."""
    damp = DAMPING * torch.diag(h).mean()
    for _ in range(8):
        chol, info = torch.linalg.cholesky_ex(h)
        if info == 0:
            inv = torch.cholesky_inverse(chol)
            return torch.linalg.cholesky(inv, upper=True)
        h = h + damp * torch.eye(h.shape[0], dtype=h.dtype)
        damp *= 10
    raise ValueError("the calibration Hessian is not positive definite even with damping")
