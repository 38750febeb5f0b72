"""AWQ (Lin et al., 2023): activation-aware per-input-channel scales before int4 rounding.

A few input channels of a layer carry much larger activations than the rest; their weights
matter more to the output, yet group-wise int4 gives them the same relative precision as the
others. AWQ multiplies those weight columns by ``s > 1`` before quantizing and divides the
activations by ``s`` where it costs nothing: in the RMSNorm weight that feeds the layer, or in
the rows of the up projection that feeds the down projection (``down(act(gate) * up)`` is
linear in ``up``). The float model is unchanged; only what the quantizer sees changes.

The scales are ``s = a^alpha`` with ``a`` the RMS of each input channel on the calibration text
(the square root of the Hessian diagonal GPTQ collects anyway), normalized so that
``max(s) * min(s) = 1``, and ``alpha`` is searched on a grid for the lowest output error
``tr(E H E^T)``, ``E = Q(W s) / s - W``, of the layers that share the input. ``alpha = 0``
(``s = 1``, plain rounding) is on the grid, so the search never picks scales that raise that
error. The reference implementation measures the error on the block's output (after attention
or the MLP); this one on the linear layers' outputs, which the Hessian gives without running
the model again, on 256 evenly spaced rows of each matrix (the scales are shared by all rows,
and this keeps the search to seconds a layer). The query/key/value -> output pair is not
scaled (with grouped-query attention a value channel feeds several heads' output columns).
The clipping search of the rounding that follows judges each group by its output error too
(``rtn.quantize_int4(..., hessian=)``).

After scaling, the codes come from round-to-nearest or, for ``int4-awq-gptq``, from GPTQ on the
Hessian of the scaled inputs ``S^-1 H S^-1``.
"""

from __future__ import annotations

import torch
from torch import nn

from fastforward.layers.norm import RMSNorm
from fastforward.quant.rtn import group_for, int4_grid

GRID = 20  # alpha in 0, 1/20, ..., 19/20 (the reference implementation's grid)
SEARCH_ROWS = 256  # output rows the error is measured on (evenly spaced; the scales are shared)


def fake_int4(weight: torch.Tensor, group: int) -> torch.Tensor:
    """``weight`` rounded to int4 over each group's full range with bf16 scales and zeros, as
    ``dequantize_int4(quantize_int4(weight, group, clip=False))`` but without the packing (the
    search calls it 20 times per layer)."""
    n, k = weight.shape
    w = weight.reshape(n, k // group, group)
    scales, zeros = int4_grid(w.amin(dim=2, keepdim=True), w.amax(dim=2, keepdim=True))
    s, z = scales.float(), zeros.float()
    q = (w - z).div_(s).add_(8).round_().clamp_(0, 15)
    return q.sub_(8).mul_(s).add_(z).view(n, k)


def output_error(weight: torch.Tensor, scales: torch.Tensor, hessian: torch.Tensor, group: int):
    """``tr(E H E^T)`` for ``E = Q(W diag(s)) diag(s)^-1 - W``: the summed squared error of the
    layer's outputs over the calibration inputs (``H = X^T X / n``) after int4 rounding of the
    full range (the clipping search comes after the scales, as in the reference)."""
    err = fake_int4(weight * scales, group).div_(scales).sub_(weight)
    return float(((err @ hessian) * err).sum())


def search_scales(
    weight: torch.Tensor, hessian: torch.Tensor, group: int
) -> tuple[torch.Tensor, float]:
    """The per-input-channel scales (and their ``alpha``) for ``weight [N, K]`` (fused q/k/v
    or gate/up: the matrices that read the same input) whose input Hessian is ``hessian``."""
    group = group_for(hessian.shape[0], group)
    rms = hessian.diagonal().clamp(min=0).sqrt()
    rms = rms.clamp(min=max(float(rms.max()), 1e-12) * 1e-4)  # dead channels: not 0^alpha
    rows = weight[:: max(1, len(weight) // SEARCH_ROWS)]
    best_scales, best_alpha, best_err = torch.ones_like(rms), 0.0, float("inf")
    for i in range(GRID):
        alpha = i / GRID
        s = rms.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        err = output_error(rows, s, hessian, group)
        if err < best_err:
            best_scales, best_alpha, best_err = s, alpha, err
    return best_scales, best_alpha


def _fold_into_norm(norm: RMSNorm, scales: torch.Tensor) -> None:
    """Divide the norm's output by ``scales``."""
    if norm.unit_offset:  # Gemma: the scale is 1 + weight
        norm.weight.copy_((1.0 + norm.weight.float()) / scales - 1.0)
    else:
        norm.weight.div_(scales)


def _scale_hessian(hessian: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The Hessian of inputs divided by ``scales``: ``S^-1 H S^-1``."""
    return hessian / scales[:, None] / scales[None, :]


@torch.no_grad()
def awq_scale_model(
    model: nn.Module, hessians: dict[str, torch.Tensor], group: int
) -> dict[str, float]:
    """Scale every decoder layer of a float32 model in place (``awq_scale_layer``). Returns
    the ``alpha`` chosen for each scaled linear, by name."""
    names = {m: n for n, m in model.named_modules()}
    chosen: dict[str, float] = {}
    for layer in getattr(model, "layers", []):
        chosen.update(awq_scale_layer(layer, names, hessians, group))
    return chosen


@torch.no_grad()
def awq_scale_layer(
    layer: nn.Module, names: dict[nn.Module, str], hessians: dict[str, torch.Tensor], group: int
) -> dict[str, float]:
    """Scale one decoder layer in place (norm -> q/k/v, norm -> gate/up, up -> down) and the
    matching ``hessians`` (by module name, ``names`` maps modules to theirs) so that they
    describe the scaled inputs. Returns the ``alpha`` chosen for each scaled linear; linears
    of another shape, or without a Hessian, are left alone."""
    chosen: dict[str, float] = {}
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    mlp_norm = getattr(layer, "pre_feedforward_layernorm", None) or getattr(
        layer, "post_attention_layernorm", None
    )
    pairs = [
        (getattr(layer, "input_layernorm", None), getattr(attn, "qkv_proj", None)),
        (mlp_norm, getattr(mlp, "gate_up_proj", None)),
    ]
    for norm, linear in pairs:
        if not isinstance(norm, RMSNorm) or not isinstance(linear, nn.Linear):
            continue
        name = names[linear]
        if name not in hessians:
            continue
        s, chosen[name] = search_scales(linear.weight.detach().float(), hessians[name], group)
        _fold_into_norm(norm, s)
        linear.weight.mul_(s)
        hessians[name] = _scale_hessian(hessians[name], s)
    gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
    if not (isinstance(gate_up, nn.Linear) and isinstance(down, nn.Linear)):
        return chosen
    name, inter = names[down], down.in_features
    if name not in hessians or gate_up.out_features != 2 * inter or gate_up.bias is not None:
        return chosen
    s, chosen[name] = search_scales(down.weight.detach().float(), hessians[name], group)
    gate_up.weight[inter:].div_(s[:, None])  # the up rows: down's inputs / s
    down.weight.mul_(s)
    hessians[name] = _scale_hessian(hessians[name], s)
    return chosen
