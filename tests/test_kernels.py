"""The C++ CPU kernels against the plain PyTorch reference paths they replace."""

from __future__ import annotations

import pytest
import torch

from fastforward import kernels
from fastforward.attention.metadata import AttentionMetadata, GroupMetadata
from fastforward.attention.reference import paged_attention, write_kv
from fastforward.kv.quant import dequantize, quantize

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "k", "n"), [(1, 576, 1536), (7, 64, 40), (13, 100, 17), (64, 96, 64)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_bf16_matches_dense(dtype, m, k, n, bias):
    torch.manual_seed(m * n)
    w = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(m, k, dtype=dtype)
    b = torch.randn(n) if bias else None
    ops = kernels.ops()
    packed = ops.pack_linear_weight(w)
    assert torch.equal(ops.unpack_linear_weight(packed, n), w)
    y = ops.linear_bf16(x, packed, n, b)
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    assert y.dtype == dtype and y.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * k**0.5)


@pytest.mark.parametrize("rows", [9, 64])
def test_packed_linear_large_batches_take_onednn_with_the_dense_numbers(monkeypatch, rows):
    """Without the tiles, above ``packed_rows_max`` rows a PackedLinear multiplies through oneDNN
    from a weight prepacked in its blocked layout (where PyTorch has oneDNN): the same numbers
    as ``F.linear`` on the plain bf16 weight, in 3-D too, and no dense copy is kept for it."""
    import torch.nn.functional as F

    from fastforward.kernels import linear
    from fastforward.kernels.linear import PackedLinear

    # as where the kernels have no vdpbf16ps on a CPU with native bf16
    monkeypatch.setattr(linear, "tiles_pack", lambda w: None)
    torch.manual_seed(rows)
    w, b = torch.randn(96, 64), torch.randn(96)
    lin = PackedLinear(w, b, None, keep_dense=True, packed_rows_max=8)
    if lin.onednn is None:
        pytest.skip("this PyTorch has no oneDNN")
    assert lin.dense is None
    x = torch.randn(rows, 64).to(torch.bfloat16)
    ref = F.linear(x, w.to(torch.bfloat16)) + b
    assert torch.equal(lin(x), ref.to(torch.bfloat16))
    assert torch.equal(lin(x.view(1, rows, 64)), lin(x).view(1, rows, 96))
    assert torch.equal(lin.weight, w.to(torch.bfloat16))  # unpacked from the packed copy


def test_packed_linear_without_native_bf16_takes_fp32_for_large_batches():
    """Without native bf16 (``fp32_rows_min`` set), batches of that many rows multiply in
    float32 on the converted bf16 weight, smaller ones on the packed kernel; both match a
    float64 product of the same bf16 numbers, and the fused stack leaves the large batches to
    the module."""
    import torch.nn.functional as F

    from fastforward.kernels.decoder import _add_linear
    from fastforward.kernels.linear import PackedLinear

    torch.manual_seed(3)
    w, b = torch.randn(96, 64), torch.randn(96)
    lin = PackedLinear(w, b, None, keep_dense=False, packed_rows_max=1 << 62, fp32_rows_min=4)
    wb = w.to(torch.bfloat16)
    for rows in (3, 4, 9):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        ref = (x.double() @ wb.double().t() + b.double()).to(torch.bfloat16)
        got = lin(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-2)
        if rows >= 4:  # the float32 product (linear_bf16_gemm), bit for bit
            want = kernels.ops().linear_bf16_gemm(x, lin.packed, 96, lin.bias, False)
            assert torch.equal(got, want)
    head = PackedLinear(w, None, None, keep_dense=False, packed_rows_max=1 << 62, fp32_out=True,
                        fp32_rows_min=4)  # fmt: skip
    x = torch.randn(5, 64).to(torch.bfloat16)
    assert head(x).dtype == torch.float32
    torch.testing.assert_close(head(x), F.linear(x.float(), wb.float()), rtol=1e-5, atol=1e-5)

    class Stack:
        def add_linear(self, *args):
            return 7

    assert _add_linear(Stack(), lin) == (7, 3)  # the stack takes up to 3 rows, then the module


needs_amx = pytest.mark.skipif(
    not (kernels.available() and kernels.ops().amx_native()), reason="the CPU has no AMX"
)
needs_tiles = pytest.mark.skipif(
    not (kernels.available() and kernels.ops().bf16_tiles_native()),
    reason="the CPU has no AVX512-BF16",
)

needs_prompt_f32 = pytest.mark.skipif(
    not (kernels.available() and kernels.ops().prefill_attention_f32_native(64)),
    reason="paged_prefill_attention needs AVX-512",
)


@needs_tiles
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [
        (1, 64, 16),
        (1, 33, 200),
        (1, 1536, 576),
        (2, 33, 200),
        (7, 64, 80),
        (9, 576, 960),
        (17, 100, 17),
        (64, 1536, 576),
        (70, 33, 200),
        (130, 96, 48),
        (600, 64, 144),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_amx_matches_fp32_accumulation(m, k, n, bias):
    """The tiles (AMX, or vdpbf16ps in registers without it; one row: vdpbf16ps streaming
    them): fp32 sums of the bf16 products whatever the shape (rows, K and N padded to whole
    tiles, an odd K, row and feature counts that are not whole register blocks); fp32 out as
    computed, bf16 out rounded once; a row does not depend on the rows batched with it."""
    torch.manual_seed(m * k + n)
    w = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(m, k).to(torch.bfloat16)
    b = torch.randn(n) if bias else None
    ops = kernels.ops()
    packed = ops.pack_amx_weight(w)
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    y32 = ops.linear_amx(x, packed, n, b, True)
    assert y32.dtype == torch.float32 and y32.shape == (m, n)
    torch.testing.assert_close(y32.double(), ref, rtol=1e-5, atol=1e-4)
    y16 = ops.linear_amx(x, packed, n, b, False)
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, y32.to(torch.bfloat16))
    assert torch.equal(ops.linear_amx(x[m // 2 :], packed, n, b, True), y32[m // 2 :])
    if not ops.amx_native():  # vdpbf16ps: the same sums for one row as in any batch
        assert torch.equal(ops.linear_amx(x[-1:], packed, n, b, True), y32[-1:])


@needs_tiles
def test_linear_amx_no_rows_and_unpack():
    """No rows give an empty result (a prompt chunk with no sequence to sample); the tiles
    unpack to the bf16 weight bit for bit, padding dropped."""
    ops = kernels.ops()
    torch.manual_seed(0)
    for n, k in [(17, 33), (96, 64), (200, 576)]:
        w = torch.randn(n, k).to(torch.bfloat16)
        packed = ops.pack_amx_weight(w)
        assert torch.equal(ops.unpack_amx_weight(packed, n, k), w)
        y = ops.linear_amx(torch.empty(0, k, dtype=torch.bfloat16), packed, n, None, True)
        assert y.shape == (0, n)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.unpack_amx_weight(packed, n + 16, k)


@needs_tiles
def test_packed_linear_batches_take_the_tiles():
    """On a CPU with AVX512-BF16 every batch goes through the tiles (no packed, dense or
    oneDNN copy kept); the output projection gets fp32 logits straight from them. Above
    ``AMX_ROWS_MAX`` an AMX CPU takes F.linear on the weight unpacked from the tiles, a CPU
    without AMX stays on vdpbf16ps (the same sums, so a row's logits do not depend on the
    batch)."""
    import torch.nn.functional as F

    from fastforward.kernels.linear import AMX_ROWS_MAX, PackedLinear

    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    lin = PackedLinear(w, b, None, keep_dense=True, packed_rows_max=8)
    # the tiles are the one copy: single rows take them too, and the weight unpacks from them
    assert lin.tiles is not None and lin.onednn is None and lin.dense is None
    assert lin.packed is None and torch.equal(lin.weight, w.to(torch.bfloat16))
    one = torch.randn(1, 64).to(torch.bfloat16)
    exact_one = one.double() @ w.to(torch.bfloat16).double().t() + b.double()
    torch.testing.assert_close(lin(one).double(), exact_one, rtol=1e-2, atol=1e-2)
    x = torch.randn(2, 20, 64).to(torch.bfloat16)
    ref = x.double() @ w.to(torch.bfloat16).double().t() + b.double()
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 20, 96)
    torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2)
    head = PackedLinear(w, None, None, keep_dense=True, packed_rows_max=8, fp32_out=True)
    logits = head(x[0])
    assert logits.dtype == torch.float32 and head.dense is None
    exact = x[0].double() @ w.to(torch.bfloat16).double().t()
    torch.testing.assert_close(logits.double(), exact, rtol=1e-5, atol=1e-4)
    big = torch.randn(AMX_ROWS_MAX + 3, 64).to(torch.bfloat16)
    wb = w.to(torch.bfloat16)
    if not kernels.ops().amx_native():
        torch.testing.assert_close(
            head(big).double(), big.double() @ wb.double().t(), rtol=1e-5, atol=1e-4
        )
        assert torch.equal(head(big)[-1:], head(big[-1:]))
        assert torch.equal(lin(big), kernels.ops().linear_amx(big, lin.tiles, 96, b, False))
        return
    # above AMX_ROWS_MAX: F.linear's numbers on the weight unpacked from the tiles
    assert torch.equal(lin(big), (F.linear(big, wb) + b).to(torch.bfloat16))
    top = head(big).topk(4, dim=-1).indices  # rescored in fp32
    torch.testing.assert_close(
        head(big).gather(-1, top).double(),
        (big.double() @ wb.double().t()).gather(-1, top),
        rtol=1e-5,
        atol=1e-4,
    )


@pytest.mark.parametrize(("k", "n"), [(576, 1536), (100, 200), (33, 17)])
def test_linear_bf16_rows_do_not_depend_on_the_batch(k, n):
    """A row's output is bit-identical alone and in any batch (every block shape sums k in
    the same order), so greedy output does not change with the batch size."""
    torch.manual_seed(k)
    w = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(13, k)
    ops = kernels.ops()
    packed = ops.pack_linear_weight(w)
    batched = ops.linear_bf16(x, packed, n, None)
    for i in range(13):
        assert torch.equal(ops.linear_bf16(x[i : i + 1], packed, n, None), batched[i : i + 1])
    assert torch.equal(ops.linear_bf16(x[3:10], packed, n, None), batched[3:10])


# the int4 table (code - 8) takes integer dot products: AVX512-VNNI is enough
needs_int4 = pytest.mark.skipif(
    not (kernels.available() and kernels.ops().int8_rows_native()), reason="no AVX512-VNNI"
)


def _skip_without_table_kernel(levels: str) -> None:
    if levels != "int4" and not kernels.ops().linear_q4_native():
        pytest.skip("codebook tables need AVX512-BF16")


@needs_int4
@pytest.mark.parametrize(("m", "n", "k", "group"), [(1, 576, 576, 32), (2, 80, 256, 64),
                         (3, 48, 128, 128), (4, 1536, 576, 32), (5, 16, 64, 32), (8, 96, 384, 64),
                         (9, 96, 384, 64)])  # fmt: skip
@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("levels", ["int4", "centroids"])
def test_linear_q4_matches_dense(m, n, k, group, zeros, levels):
    """Rows in blocks of 1-4 and tiles in blocks of 4 with tails; the table (int4 levels, which
    the kernel builds by bit logic, or codebook centroids, looked up), scales and zeros against
    a float64 matmul of the expanded weight. From 5-32 rows (Q4_AMX_ROWS_MIN, Q4_DP_ROWS_MIN)
    a CPU with AVX512-BF16 takes linear_q4_amx, which rounds the expanded weight to bf16 once,
    as a dequantize-then-bf16-matmul would."""
    _skip_without_table_kernel(levels)
    x, packed, sz, table, w = _q4_case(m, n, k, group, zeros, levels)
    y = kernels.ops().linear_q4(x, packed, sz, table, group)
    ops = kernels.ops()
    expanded = Q4_AMX_ROWS_MIN if ops.amx_native() else Q4_DP_ROWS_MIN
    if m >= expanded[levels] and (ops.amx_native() or ops.bf16_tiles_native()):
        w = w.to(torch.bfloat16).double()
    ref = x.double() @ w.t()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # fp32 accumulation, then one bf16 rounding of the output (2^-9 relative)
    torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-4 * ref.abs().max())


@needs_int4
@pytest.mark.parametrize("m", [1, 2, 4])
def test_linear_q4_int4_rows_with_an_outlier(m):
    """int4 rows (code - 8) of up to 4 rows run integer dot products on x held as int16 per group
    (max |x| / 32767 a step): a group whose largest element is 1000x the rest keeps its small
    elements' share of the output to the bf16 tolerance; a zero group contributes exactly 0."""
    x, packed, sz, table, w = _q4_case(m, 96, 256, 32, True, "int4")
    x = x.double()
    x[:, 5] = 1000.0 * x[:, 5].sign()  # one outlier in group 0
    x[:, 64:96] = 0.0  # group 2 all zero
    x = x.to(torch.bfloat16)
    y = kernels.ops().linear_q4(x, packed, sz, table, 32).double()
    ref = x.double() @ w.t()
    torch.testing.assert_close(y, ref, rtol=2**-8, atol=1e-4 * ref.abs().max())
    # without the outlier's column the rest still matches: the small elements were not lost
    x2 = x.clone()
    x2[:, 5] = 0
    y2 = kernels.ops().linear_q4(x2, packed, sz, table, 32).double()
    ref2 = x2.double() @ w.t()
    torch.testing.assert_close(y - y2, ref - ref2, rtol=2**-7, atol=2e-3 * ref.abs().max())


# csrc/linear_q4.cpp kQ4Int4AmxRowsMin, kQ4AmxRowsMin
# csrc/linear_q4.cpp: from these rows linear_q4 hands a batch to linear_q4_amx (AMX tiles, or
# vdpbf16ps on a CPU with AVX512-BF16 alone)
Q4_AMX_ROWS_MIN = {"int4": 9, "centroids": 5}
Q4_DP_ROWS_MIN = {"int4": 16, "centroids": 16}


@needs_int4
@pytest.mark.parametrize("m", [1, 2])
def test_linear_q4_few_rows_give_the_same_bits_on_any_thread_count(m):
    """Decode's one or two rows split the blocks into one range per thread, and threads done
    early take the others' last blocks (steal_for): 37 blocks on 1, 2, 3 and 5 threads, many
    times over, must give the same bits (no block skipped or done twice, whichever thread
    takes it) and match the float64 matmul."""
    x, packed, sz, table, w = _q4_case(m, 16 * 37, 576, 32, True, "int4")
    ops = kernels.ops()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.linear_q4(x, packed, sz, table, 32)
        for t in (2, 3, 5):
            torch.set_num_threads(t)
            for _ in range(50):
                assert torch.equal(ops.linear_q4(x, packed, sz, table, 32), one)
    finally:
        torch.set_num_threads(threads)
    ref = x.double() @ w.t()
    torch.testing.assert_close(one.double(), ref, rtol=2**-8, atol=1e-4 * ref.abs().max())


def _q4_case(m, n, k, group, zeros, levels):
    """Random codes, table, scales (and zeros) in linear_q4's layout, bf16 rows, and the
    float64 weight they stand for."""
    from fastforward.quant import q4pack

    gen = torch.Generator().manual_seed(m * n + k)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    table = (torch.randn(16, generator=gen) * 4).to(torch.bfloat16)
    if levels == "int4":
        table = (torch.arange(16) - 8).to(torch.bfloat16)
    s = (torch.rand(n, k // group, generator=gen) * 0.1 + 0.01).to(torch.bfloat16)
    z = (torch.randn(n, k // group, generator=gen) * 0.05).to(torch.bfloat16)
    w = table.double()[codes.long()].view(n, -1, group) * s.double()[..., None]
    w = (w + z.double()[..., None] if zeros else w).view(n, k)
    packed = q4pack.pack(codes)
    assert torch.equal(q4pack.unpack(packed), codes)
    sz = q4pack.pack_scales(s, z) if zeros else q4pack.pack_scales(s)
    assert all(torch.equal(a, b) for a, b in zip(q4pack.unpack_scales(sz), (s, z), strict=False))
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    return x, packed, sz, table, w


@pytest.mark.parametrize(("n", "k", "group"), [(48, 128, 32), (96, 384, 64), (16, 64, 4)])
@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("levels", ["int4", "centroids"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_q4_expands_the_weight(n, k, group, zeros, levels, dtype):
    """linear_q4's layout expanded to the dense weight of large batches: table[code] * s (+ z)
    in float32, rounded once for a bf16 output; an output of the wrong shape or dtype is
    refused."""
    _, packed, sz, table, w = _q4_case(1, n, k, group, zeros, levels)
    out = torch.empty(n, k, dtype=dtype)
    kernels.ops().dequantize_q4(packed, sz, table, out)
    tol = 2**-8 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(out.double(), w, rtol=tol, atol=tol * w.abs().max())
    with pytest.raises(RuntimeError, match="out must be"):
        kernels.ops().dequantize_q4(packed, sz, table, torch.empty(n, k, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="out must be"):
        kernels.ops().dequantize_q4(packed, sz, table, torch.empty(n + 16, k))
    # some rows (embedding lookups): exactly those rows of the whole expansion
    ids = torch.tensor([n - 1, 0, n // 3, n // 3, n // 2])
    rows = torch.empty(len(ids), k, dtype=dtype)
    kernels.ops().dequantize_q4(packed, sz, table, rows, ids)
    assert torch.equal(rows, out[ids])
    with pytest.raises(RuntimeError, match="outside the weight"):
        kernels.ops().dequantize_q4(packed, sz, table, rows, torch.tensor([0, 1, 2, 3, n]))
    with pytest.raises(RuntimeError, match="out must be"):
        kernels.ops().dequantize_q4(packed, sz, table, torch.empty(n, k), ids)
    with pytest.raises(RuntimeError, match="1-D int64"):
        kernels.ops().dequantize_q4(packed, sz, table, rows, ids.int())


@needs_int4
@pytest.mark.parametrize("expand", [torch.float32, torch.bfloat16])
def test_int4_batches_above_the_kernel_rows_expand_the_weight(expand):
    """Past native_rows_max (on CPUs with native bf16 but no AMX; lowered here) an Int4Linear on
    the native layout expands its weight with dequantize_q4 for one dense matmul: the same
    product as the kernel's, to bf16 rounding."""
    from fastforward.quant.int4 import Int4Linear
    from fastforward.quant.rtn import quantize_int4

    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(11)) * 0.05
    module = Int4Linear(quantize_int4(w, 32))
    module.use_native_kernel()
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    kernel = module(x).float()
    module.native_rows_max, module.expand_dtype = 4, expand
    dense = module(x).float()
    expected = x.float() @ module.dequantize().t()
    for got in (kernel, dense):
        torch.testing.assert_close(got, expected, atol=1e-2 * expected.abs().max(), rtol=0)


@needs_tiles
@pytest.mark.parametrize(("m", "n", "k", "group"), [(1, 576, 576, 32), (16, 48, 128, 128),
                         (70, 80, 36, 4), (64, 1536, 576, 32), (600, 96, 384, 64)])  # fmt: skip
@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("levels", ["int4", "centroids"])
def test_linear_q4_amx_matches_bf16_weight(m, n, k, group, zeros, levels):
    """The codes expanded to bf16 tiles: fp32 accumulation over the weight rounded once to bf16
    (K not a multiple of 32, rows not of 16, more rows than one pass); each row independent of
    the batch around it; linear_q4 hands it batches from Q4_AMX_ROWS_MIN rows."""
    x, packed, sz, table, w = _q4_case(m, n, k, group, zeros, levels)
    ops = kernels.ops()
    y = ops.linear_q4_amx(x, packed, sz, table, group)
    ref = x.double() @ w.to(torch.bfloat16).double().t()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-5 * ref.abs().max())
    assert torch.equal(ops.linear_q4_amx(x[m // 3 :], packed, sz, table, group), y[m // 3 :])
    amx = kernels.ops().amx_native()
    if m >= (Q4_AMX_ROWS_MIN if amx else Q4_DP_ROWS_MIN)[levels]:
        assert torch.equal(ops.linear_q4(x, packed, sz, table, group), y)
    _skip_without_table_kernel(levels)  # linear_q4's own kernel at any batch: the unrounded weight
    rows = ops.linear_q4_rows(x, packed, sz, table, group).double()
    exact = x.double() @ w.t()
    torch.testing.assert_close(rows, exact, rtol=2**-8, atol=1e-4 * exact.abs().max())


I8G_ROWS_MAX = 16  # csrc/ops.h kI8gRowsMax

INT8_DP = kernels.available() and kernels.ops().paged_attention_int8_native()

needs_int8_rows = pytest.mark.skipif(
    not (kernels.available() and kernels.ops().int8_rows_native()), reason="no AVX512-VNNI"
)


@needs_int8_rows
@pytest.mark.parametrize(("m", "n", "k"), [(1, 64, 64), (2, 576, 576), (3, 48, 1536), (4, 80, 96),
                                           (7, 48, 64), (16, 64, 576)])  # fmt: skip
def test_linear_i8_rows_matches_the_int8_weight(m, n, k):
    """int8 codes with one bf16 scale per output row (Int8Linear) in blocks of 16 rows: exact
    integer products with each row of x held as int16 per 32 inputs, against a float64 matmul
    of the unrounded weight (tiles in blocks of 4 with tails, rows in blocks of 1-4); each row
    independent of the batch around it; a 3-d x keeps its leading shape; bad input is refused."""
    gen = torch.Generator().manual_seed(m * n + k)
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, generator=gen) * 0.01 + 1e-3).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    blocks = codes.view(n // 16, 16, k // 2, 2).transpose(1, 2).contiguous()
    ops = kernels.ops()
    y = ops.linear_i8_rows(x, blocks, scales)
    ref = x.double() @ (codes.double() * scales.double()[:, None]).t()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-4 * ref.abs().max())
    assert torch.equal(ops.linear_i8_rows(x[m - 1 :], blocks, scales), y[m - 1 :])
    assert torch.equal(ops.linear_i8_rows(x.view(1, m, k), blocks, scales), y.view(1, m, n))
    with pytest.raises(RuntimeError, match="scales"):
        ops.linear_i8_rows(x, blocks, scales.float())
    with pytest.raises(RuntimeError, match="features"):
        ops.linear_i8_rows(x[:, :32], blocks, scales)


@needs_tiles
@needs_int8_rows
@pytest.mark.parametrize(("m", "n", "k"), [(17, 64, 576), (64, 576, 1536), (300, 48, 96)])
def test_int8_linear_batches_take_the_expanded_tiles(m, n, k):
    """Int8Linear on the kernels: up to its few-row limit linear_i8_rows, above it the codes
    times each output row's scale expanded to bf16 tiles (linear_i8g_amx with one group of K),
    against a float64 matmul of that weight rounded once to bf16; each row independent of the
    batch around it."""
    from fastforward.quant.int8 import Int8Linear, Int8Weights

    gen = torch.Generator().manual_seed(m + n + k)
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, generator=gen) * 0.01 + 1e-3).to(torch.bfloat16)
    module = Int8Linear(Int8Weights(codes, scales))
    module.use_native_kernel()
    assert module.native and module.tile_scales is not None
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    y = module(x)
    w = (codes.double() * scales.double()[:, None]).to(torch.bfloat16).double()
    ref = x.double() @ w.t()
    torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-5 * ref.abs().max())
    assert torch.equal(module(x[m - 17 :]), y[m - 17 :])


def _i8g_refuses_bad_input(op, x, codes, scales, group):
    """Both int8-group kernels (one shared check): a group size not dividing the codes, scales
    of the wrong dtype, x of the wrong width."""
    with pytest.raises(RuntimeError, match="group size"):
        op(x, codes, scales, 3)
    with pytest.raises(RuntimeError, match="scales"):
        op(x, codes, scales.half(), group)
    with pytest.raises(RuntimeError, match="features"):
        op(x[:, 1:], codes, scales, group)


def _i8g_case(m, n, k, group, scale_dtype, seed):
    """Random int8 codes and group scales (rounded to ``scale_dtype``, as GGUF stores them) in
    the int8-group layout, bf16 rows, and the float64 weight they stand for."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.01).to(scale_dtype).float()
    blocks = codes.view(n // 16, 16, k // 2, 2).transpose(1, 2).contiguous()
    block_scales = scales.view(n // 16, 16, -1).transpose(1, 2).contiguous()
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = (codes.double().view(n, -1, group) * scales.double()[..., None]).view(n, k)
    return x, blocks, block_scales, w


@needs_int8_rows
@pytest.mark.parametrize(("m", "n", "k", "group"), [(1, 64, 64, 32), (2, 4096, 576, 32),
                         (3, 48, 96, 16), (4, 32, 36, 2), (7, 80, 64, 32), (16, 48, 96, 16)])  # fmt: skip
def test_linear_i8g_rows_matches_the_group_scaled_weight(m, n, k, group):
    """int8 codes with group scales (GGUF Q8_0/Q6_K) for few rows, the path of CPUs with
    AVX512-VNNI but no AMX: exact integer products of the codes with each row held as int16
    per group, against a float64 matmul of the unrounded weight; each row independent of the
    batch around it; a 3-d x keeps its leading shape; bad input is refused."""
    x, blocks, block_scales, w = _i8g_case(m, n, k, group, torch.float32, m * n + k)
    ops = kernels.ops()
    y = ops.linear_i8g_rows(x, blocks, block_scales, group)
    ref = x.double() @ w.t()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-4 * ref.abs().max())
    assert torch.equal(ops.linear_i8g_rows(x[m - 1 :], blocks, block_scales, group), y[m - 1 :])
    got = ops.linear_i8g_rows(x.view(1, m, k), blocks, block_scales, group)
    assert torch.equal(got, y.view(1, m, n))
    _i8g_refuses_bad_input(ops.linear_i8g_rows, x, blocks, block_scales, group)


@needs_tiles
@pytest.mark.parametrize(("m", "n", "k", "group"), [(1, 64, 64, 32), (70, 48, 96, 16),
                         (17, 4096, 576, 32), (600, 32, 36, 2), (3, 4096, 576, 32),
                         (4, 48, 96, 16), (2, 32, 36, 2), (16, 80, 64, 32), (7, 48, 96, 16)])  # fmt: skip
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_linear_i8g_amx_matches_bf16_weight(m, n, k, group, scale_dtype):
    """int8 codes with group scales (GGUF Q8_0/Q5_0/Q6_K) expanded to bf16 tiles: fp32
    accumulation over code * scale rounded once to bf16 (K not a multiple of 32, rows not of
    16, more rows than one pass), each row independent of the batch around it. Up to
    I8G_ROWS_MAX rows take linear_i8g_rows (every AMX CPU has AVX512-VNNI): exact integer
    products of the codes and each row held as int16 per group, so the reference is the
    unrounded weight."""
    x, tiles, tile_scales, w = _i8g_case(m, n, k, group, scale_dtype, m + n + k)
    ops = kernels.ops()
    y = ops.linear_i8g_amx(x, tiles, tile_scales, group)
    ref = x.double() @ (w if m <= I8G_ROWS_MAX else w.to(torch.bfloat16).double()).t()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    atol = (1e-4 if m <= I8G_ROWS_MAX else 1e-5) * ref.abs().max()
    torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=atol)
    if (m <= I8G_ROWS_MAX) == (m - m // 3 <= I8G_ROWS_MAX):  # the same kernel for both
        assert torch.equal(ops.linear_i8g_amx(x[m // 3 :], tiles, tile_scales, group), y[m // 3 :])
    _i8g_refuses_bad_input(ops.linear_i8g_amx, x, tiles, tile_scales, group)


@needs_int4
@pytest.mark.parametrize("method", ["int4", "codebook4"])
def test_engine_moves_4bit_layers_onto_the_kernel(tiny_model_dir, method):
    from fastforward import LLM

    _skip_without_table_kernel("int4" if method == "int4" else "centroids")
    directory, _ = tiny_model_dir("llama3-rope-tied")  # the packed embedding is the head too
    ids = list(range(3, 60))
    native = LLM(str(directory), quantization=method, kernels="native", download_progress=False)
    torch_llm = LLM(str(directory), quantization=method, kernels="torch", download_progress=False)
    report = native.engine.kernels
    assert report.quantized and all(m.native for m in _4bit(native.engine.model))
    assert not any(m.native for m in _4bit(torch_llm.engine.model))
    # the same weights through two kernels: log-probs within bf16 noise of each other
    diff = (native.engine.score(ids) - torch_llm.engine.score(ids)).abs().max()
    assert diff < 0.02


def _4bit(model):
    from fastforward.quant.codebook import CodebookLinear
    from fastforward.quant.int4 import Int4Linear

    found = [m for m in model.modules() if isinstance(m, Int4Linear | CodebookLinear)]
    assert found
    return found


@needs_int4
def test_linear_q4_rejects_bad_input():
    from fastforward.quant import q4pack

    ops = kernels.ops()
    packed = q4pack.pack(torch.zeros(32, 64, dtype=torch.uint8))
    sz = q4pack.pack_scales(torch.ones(32, 2))
    table = torch.zeros(16, dtype=torch.bfloat16)
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="features"):
        ops.linear_q4(torch.randn(2, 60).to(torch.bfloat16), packed, sz, table, 32)
    with pytest.raises(RuntimeError, match="group size"):
        ops.linear_q4(x, packed, sz, table, 48)
    with pytest.raises(RuntimeError, match="scales"):
        ops.linear_q4(x, packed, sz, table, 16)
    with pytest.raises(RuntimeError, match="table"):
        ops.linear_q4(x, packed, sz, table[:8], 32)


def test_linear_bf16_rejects_bad_shapes():
    ops = kernels.ops()
    packed = ops.pack_linear_weight(torch.randn(32, 16))
    with pytest.raises(RuntimeError, match="features"):
        ops.linear_bf16(torch.randn(2, 15), packed, 32, None)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.linear_bf16(torch.randn(2, 16), packed, 64, None)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp32_out", [False, True])
@pytest.mark.parametrize(
    ("m", "k", "n"), [(1, 64, 16), (130, 100, 200), (64, 576, 96), (7, 33, 1000)]
)  # fmt: skip
def test_linear_bf16_gemm_matches_float64(x_dtype, fp32_out, m, k, n):
    """The float32 GEMM on the packed weight expanded a chunk at a time: several chunks (n 200
    and 1,000: 13 and 63 tiles of 16, chunks of 6), a last tile cut short, k not a multiple of
    16, one row; the float64 product of the same bf16 numbers within float32 rounding (then
    the output's dtype), with and without a bias, in 3-D too."""
    torch.manual_seed(m + k + n)
    w = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(m, k).to(x_dtype)
    ops = kernels.ops()
    packed = ops.pack_linear_weight(w)
    for b in (None, torch.randn(n)):
        y = ops.linear_bf16_gemm(x, packed, n, b, fp32_out)
        ref = x.double() @ w.double().t() + (0 if b is None else b.double())
        want = torch.float32 if fp32_out else x_dtype
        assert y.dtype == want and y.shape == (m, n)
        tol = 1e-5 if want == torch.float32 else 1e-2
        torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * k**0.5)
        y3 = ops.linear_bf16_gemm(x.view(1, m, k), packed, n, b, fp32_out)
        assert torch.equal(y3, y.view(1, m, n))


def test_linear_bf16_gemm_rejects_bad_input():
    ops = kernels.ops()
    packed = ops.pack_linear_weight(torch.randn(32, 16))
    with pytest.raises(RuntimeError, match="features"):
        ops.linear_bf16_gemm(torch.randn(2, 15), packed, 32, None, False)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.linear_bf16_gemm(torch.randn(2, 16), packed, 64, None, False)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.linear_bf16_gemm(torch.ones(2, 16, dtype=torch.int32), packed, 32, None, False)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear_bf16_gemm(torch.randn(2, 16), packed, 32, torch.randn(31), False)
    assert ops.linear_bf16_gemm(torch.randn(0, 16), packed, 32, None, False).shape == (0, 32)


def _random_batch(query_lens, context_lens, kvh, d, block_size, dtype, seed):
    """A KV cache with random contents and a shuffled block assignment, plus metadata."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for q, c in zip(query_lens, context_lens, strict=True)]
    num_blocks = 8 + sum(-(-s // block_size) for s in seq_lens)
    cache = torch.randn(2, num_blocks, block_size, kvh, d, generator=g).to(dtype)
    width = max(-(-s // block_size) for s in seq_lens)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(seq_lens), width, dtype=torch.long)
    for i, s in enumerate(seq_lens):
        n = -(-s // block_size)
        table[i, :n] = torch.tensor([perm.pop() for _ in range(n)])
    ql = torch.tensor(query_lens)
    meta = AttentionMetadata(
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), ql.cumsum(0)]),
        query_lens=ql,
        seq_lens=torch.tensor(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        groups=[GroupMetadata(block_tables=table, slot_mapping=torch.zeros(0, dtype=torch.long))],
    )
    return cache, meta


CASES = [
    # query lens, context lens, heads, kv heads, head dim, window, softcap
    ([1], [0], 4, 4, 64, None, None),
    ([1, 1, 1], [700, 5, 63], 9, 3, 64, None, None),  # decode, split-K on the long one
    ([37, 1, 5], [0, 90, 16], 9, 3, 64, None, None),  # prefill, decode, chunked prefill mixed
    ([20, 3], [0, 41], 4, 1, 24, None, None),  # MQA, head dim not a SIMD multiple
    ([37, 12, 5], [0, 0, 0], 9, 3, 64, None, None),  # fresh prompts: the reference's causal SDPA
    ([7, 1], [0, 20], 2, 1, 18, None, None),  # 9 dimension pairs: not a multiple of 4
    ([50, 1], [0, 300], 4, 2, 32, 17, None),  # sliding window
    ([9, 1], [4, 33], 4, 2, 32, None, 5.0),  # logit softcap
    ([1] * 12, list(range(0, 1200, 100)), 8, 2, 128, None, None),
    # batched decode: one item per sequence takes all its KV heads (rows head-major)
    ([1] * 8, [40, 90, 16, 17, 33, 1, 200, 64], 9, 3, 64, None, None),
    ([1] * 6 + [2], [40, 90, 16, 17, 33, 1, 30], 9, 3, 64, 25, None),
    ([1], [2000], 9, 3, 64, None, None),  # all heads per item, the key range split in parts
    # 513 keys in 8 parts of whole blocks (80 keys with blocks of 16): the last part would start
    # past the sequence's end (it read the block table past its row, a crash on 2 threads)
    ([1], [512], 9, 3, 64, None, None),
    ([1, 1], [1500, 40], 9, 3, 64, 300, None),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("block_size", [16, 5, 32])  # keys go 16 at a time within a block
def test_paged_attention_matches_reference(case, q_dtype, kv_dtype, block_size):
    query_lens, context_lens, h, kvh, d, window, softcap = case
    cache, meta = _random_batch(query_lens, context_lens, kvh, d, block_size, kv_dtype, seed=h * d)
    q = torch.randn(sum(query_lens), h, d).to(q_dtype)
    scale = d**-0.5
    group = meta.groups[0]
    ref = paged_attention(
        q.float(), cache.float(), meta, group, scale=scale, window=window, softcap=softcap
    )
    out = kernels.ops().paged_attention(
        q,
        cache,
        group.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale,
        window or 0,
        softcap or 0.0,
    )
    assert out.dtype == q_dtype and out.shape == q.shape
    tol = 2e-5 if q_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def _attention_step(query_lens, context_lens, dtype, seed, h=6, kvh=2, d=32, bs=16):
    """A cache, metadata whose slot mapping puts each query token at its position in its
    sequence's blocks, and the step's q, k, v ([T, heads, D])."""
    cache, meta = _random_batch(query_lens, context_lens, kvh, d, bs, dtype, seed=seed)
    table = meta.groups[0].block_tables
    slots = [
        int(table[i, p // bs]) * bs + p % bs
        for i, (ql, c) in enumerate(zip(query_lens, context_lens, strict=True))
        for p in range(c, c + ql)
    ]
    meta.groups[0].slot_mapping = torch.tensor(slots)
    g = torch.Generator().manual_seed(seed + 1)
    t = sum(query_lens)
    qkv = tuple(torch.randn(t, n, d, generator=g).to(dtype) for n in (h, kvh, kvh))
    return cache, meta, qkv


def _run_attention_layer(step, use_kernel, sliding_window=None, key_scale=None, **flags):
    """One attention layer (flags: its attributes; ``key_scale``: per-channel key scales) over
    a fresh copy of the step's cache."""
    from fastforward.layers.attention import Attention

    cache, meta, (q, k, v) = step
    layer = Attention(q.shape[1], k.shape[1], q.shape[2], q.shape[2] ** -0.5, sliding_window)
    if isinstance(cache, tuple):  # an int8 cache and its scales
        cache, scales = cache
        layer.kv_scales = scales.clone()
    layer.kv_cache = cache.clone()
    layer.use_kernel = use_kernel
    for name, value in flags.items():
        setattr(layer, name, value)
    layer.set_key_channel_scale(key_scale)
    meta.derived.clear()
    return layer(q, k, v, meta)


@pytest.mark.parametrize("window", [None, 20])
def test_attention_mixed_step_splits_decode_rows_from_prefill_chunks(monkeypatch, window):
    """A step with prefill chunks longer than the kernel's limit and decode rows: the chunks go
    to the reference SDPA path (padded among themselves only), the rest to the kernel, and the
    output equals the reference path's over the whole step."""
    import fastforward.layers.attention as attention_module
    from fastforward.layers.attention import KERNEL_MAX_QUERY_LEN

    query_lens, context_lens = [1, 40, 3, 1, 25, 1], [90, 0, 16, 7, 30, 200]
    step = _attention_step(query_lens, context_lens, torch.float32, seed=3)

    def run(use_kernel):
        return _run_attention_layer(step, use_kernel, sliding_window=window)

    ref = run(False)
    seen = []
    original = attention_module.paged_attention

    def spy(q_part, cache_, meta_part, *args, **kwargs):
        seen.append(meta_part.query_lens.tolist())
        return original(q_part, cache_, meta_part, *args, **kwargs)

    monkeypatch.setattr(attention_module, "paged_attention", spy)
    out = run(True)
    long_runs = [n for n in query_lens if n > KERNEL_MAX_QUERY_LEN]
    assert seen == [long_runs]  # the reference path saw only the long runs
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    ("context", "dtype", "amx", "f32"),
    [
        (0, torch.float32, False, False),
        (0, torch.bfloat16, False, False),
        (9, torch.float32, False, False),
        (40, torch.bfloat16, False, False),
        pytest.param(0, torch.bfloat16, True, False, marks=needs_amx),
        pytest.param(40, torch.bfloat16, True, False, marks=needs_amx),
        pytest.param(0, torch.bfloat16, False, True, marks=needs_prompt_f32),
        pytest.param(40, torch.float32, False, True, marks=needs_prompt_f32),
    ],
)
def test_attention_one_prompt_skips_the_reference_path(monkeypatch, context, dtype, amx, f32):
    """One prompt runs on the step's own q, k, v, without the reference path: SDPA with no
    cached context in causal mode, with context (a partial block, several blocks) as the cached
    keys and the new ones merged by their log-sum-exps, or over the cached keys and the new
    ones in one call of a prompt kernel (bf16 on an AMX CPU: paged_prefill_attention_amx;
    AVX-512: paged_prefill_attention); the reference path's output in every case."""
    import fastforward.layers.attention as attention_module

    step = _attention_step([40], [context], dtype, seed=5)

    def run(use_kernel):
        return _run_attention_layer(
            step, use_kernel, kernel_prompts_amx=amx, kernel_prompts_f32=f32
        )

    ref = run(False)
    calls, prompt_calls = [], []
    original = attention_module.paged_attention
    monkeypatch.setattr(
        attention_module, "paged_attention", lambda *a, **kw: calls.append(1) or original(*a, **kw)
    )
    for name in ("paged_prefill_attention", "paged_prefill_attention_amx"):
        op = getattr(torch.ops.fastforward, name)
        monkeypatch.setattr(
            torch.ops.fastforward, name, lambda *a, op=op, n=name: prompt_calls.append(n) or op(*a)
        )
    out = run(True)
    assert not calls
    kind = "paged_prefill_attention_amx" if amx else "paged_prefill_attention" if f32 else None
    assert prompt_calls == ([kind] if kind else [])
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@needs_prompt_f32
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize(
    ("query_lens", "context_lens", "h", "kvh", "d"),
    [([5], [0], 2, 1, 32), ([40], [0], 9, 3, 64), ([37, 12], [63, 0], 4, 2, 64),
     ([100], [30], 4, 4, 128), ([1, 17], [16, 0], 8, 1, 16), ([33, 0, 20], [0, 5, 70], 9, 3, 64),
     ([3] * 13, [0, 5, 70, 69, 0, 1, 2, 3, 4, 5, 6, 7, 8], 6, 3, 32)],
)  # fmt: skip
def test_paged_prefill_attention_matches_reference(
    dtype, block_size, query_lens, context_lens, h, kvh, d
):
    """The prompt chunks of a step on AVX-512 float32 FMAs over the paged cache (shuffled
    blocks, cached contexts, a sequence with no queries, GQA groups of 1-8 heads, items of 3,
    2 and 1 heads, head dims 16-128, query counts that are not multiples of 16, and enough
    sequences that a thread takes whole groups): float64 softmax attention of each sequence's
    queries over its keys as the reference."""
    cache, meta = _random_batch(query_lens, context_lens, kvh, d, block_size, dtype, seed=h + d)
    g = torch.Generator().manual_seed(d)
    q = torch.randn(sum(query_lens), h, d, generator=g).to(dtype)
    table = meta.groups[0].block_tables
    out = kernels.ops().paged_prefill_attention(
        q, cache, table, meta.query_start_loc, meta.seq_lens, d**-0.5
    )
    assert out.dtype == dtype and out.shape == q.shape
    qs = meta.query_start_loc.tolist()
    for b, (t, c) in enumerate(zip(query_lens, context_lens, strict=True)):
        if not t:
            continue
        s = t + c
        blocks = table[b, : -(-s // block_size)]
        kk, vv = (cache[i][blocks].flatten(0, 1)[:s].double().repeat_interleave(h // kvh, 1)
                  for i in range(2))  # fmt: skip
        scores = torch.einsum("thd,shd->hts", q[qs[b] : qs[b + 1]].double(), kk) * d**-0.5
        mask = torch.ones(t, s, dtype=torch.bool).tril(c)
        ref = torch.einsum("hts,shd->thd", scores.masked_fill(~mask, -torch.inf).softmax(-1), vv)
        tol = 2e-6 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding (2^-9)
        torch.testing.assert_close(out[qs[b] : qs[b + 1]].double(), ref, rtol=tol, atol=tol)


@needs_prompt_f32
def test_paged_prefill_attention_rejects_bad_input():
    cache, meta = _random_batch([8, 4], [0, 9], 1, 64, 16, torch.bfloat16, seed=1)
    q = torch.randn(12, 2, 64).to(torch.bfloat16)
    table, qsl, lens = meta.groups[0].block_tables, meta.query_start_loc, meta.seq_lens
    op = kernels.ops().paged_prefill_attention
    with pytest.raises(RuntimeError, match="both bf16 or both float32"):
        op(q.float(), cache, table, qsl, lens, 0.1)
    with pytest.raises(RuntimeError, match="more queries than keys"):
        op(q, cache, table, qsl, meta.query_lens - 1, 0.1)
    with pytest.raises(RuntimeError, match="outside the cache"):
        op(q, cache, table + cache.shape[1], qsl, lens, 0.1)
    with pytest.raises(RuntimeError, match="run from 0"):
        op(q[1:], cache, table, qsl, lens, 0.1)
    with pytest.raises(RuntimeError, match="KV heads"):
        op(torch.randn(12, 3, 64).to(torch.bfloat16), cache.expand(2, -1, -1, 2, -1).contiguous(),
           table, qsl, lens, 0.1)  # fmt: skip
    with pytest.raises(RuntimeError, match="head_dim"):
        op(q[..., :24], cache[..., :24].contiguous(), table, qsl, lens, 0.1)


@needs_amx
@pytest.mark.parametrize(
    ("t", "s", "h", "kvh", "d"),
    [(5, 5, 2, 1, 32), (40, 40, 9, 3, 64), (37, 100, 4, 2, 64), (100, 130, 4, 4, 128),
     (1, 17, 2, 1, 32), (33, 33, 8, 1, 64)],
)  # fmt: skip
def test_prefill_attention_amx_matches_reference(t, s, h, kvh, d):
    """Causal attention of t queries over s keys (the last t their own) on AMX tiles: GQA groups
    of 1-8 heads (items take 3 at a time), head dims 32-128, a cached context, query counts
    that are not multiples of 16; float64 softmax attention as the reference."""
    g = torch.Generator().manual_seed(t + s + h)
    q = torch.randn(t, h, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(s, kvh, d, generator=g).to(torch.bfloat16) for _ in range(2))
    out = kernels.ops().prefill_attention_amx(q, k, v, d**-0.5)
    kk, vv = (x.double().repeat_interleave(h // kvh, dim=1) for x in (k, v))
    scores = torch.einsum("thd,shd->hts", q.double(), kk) * d**-0.5
    mask = torch.ones(t, s, dtype=torch.bool).tril(s - t)
    ref = torch.einsum("hts,shd->thd", scores.masked_fill(~mask, float("-inf")).softmax(-1), vv)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    # the weights rounded to bf16 (2^-9), then the output (2^-9)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [
        pytest.param("amx", torch.bfloat16, marks=needs_amx),
        pytest.param("f32", torch.bfloat16, marks=needs_prompt_f32),
        pytest.param("f32", torch.float32, marks=needs_prompt_f32),
    ],
)
@pytest.mark.parametrize("window", [None, 20])
def test_attention_mixed_step_prompts_in_one_kernel_call(monkeypatch, kind, dtype, window):
    """A step of several prompt chunks (fresh, over a partial block and over several blocks of
    context) and decode rows: the chunks go to the prompt kernel in one call (each with its
    context; AMX tiles, or AVX-512 FMAs), the decode rows to the paged kernel, and the output
    equals the reference path's; with a sliding window the chunks stay on the reference path."""
    import fastforward.layers.attention as attention_module

    query_lens, context_lens = [1, 40, 30, 1, 25, 17], [90, 0, 9, 7, 50, 0]
    step = _attention_step(query_lens, context_lens, dtype, seed=11, h=9, kvh=3, d=64)
    flag = "kernel_prompts_amx" if kind == "amx" else "kernel_prompts_f32"

    def run(use_kernel):
        return _run_attention_layer(step, use_kernel, sliding_window=window, **{flag: True})

    ref = run(False)
    calls, prompt_calls = [], []
    original = attention_module.paged_attention
    name = "paged_prefill_attention_amx" if kind == "amx" else "paged_prefill_attention"
    op = getattr(torch.ops.fastforward, name)
    monkeypatch.setattr(
        attention_module, "paged_attention", lambda *a, **kw: calls.append(1) or original(*a, **kw)
    )
    monkeypatch.setattr(
        torch.ops.fastforward, name, lambda *a: prompt_calls.append(a[3].tolist()) or op(*a)
    )
    out = run(True)
    if window is None:
        assert not calls and prompt_calls == [[0, 40, 70, 95, 112]]  # one call, all four chunks
    else:
        assert calls and not prompt_calls
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [
        pytest.param("amx", torch.bfloat16, marks=needs_amx),
        pytest.param("f32", torch.bfloat16, marks=needs_prompt_f32),
        pytest.param("f32", torch.float32, marks=needs_prompt_f32),
    ],
)
@pytest.mark.parametrize(
    ("query_lens", "context_lens", "window", "key_scale"),
    [([40], [0], None, False),
     ([1, 40, 30, 1, 25, 17], [90, 0, 9, 7, 50, 0], None, False),
     ([1, 40, 30, 1, 25, 17], [90, 0, 9, 7, 50, 0], None, True),
     ([1, 40, 30], [90, 0, 9], 20, False)],
)  # fmt: skip
def test_attention_int8_cache_prompts_on_a_dequantized_copy(
    monkeypatch, kind, dtype, query_lens, context_lens, window, key_scale
):
    """Prompt chunks over an int8 cache (one fresh prompt; fresh and cached contexts beside
    decode rows): the blocks they read are dequantized into a cache of the model's dtype for
    one prompt kernel call (the decode rows stay on the int8 kernel) and the output is the
    reference path's over the int8 cache; also with per-channel key scales (whose queries go
    float32 but the prompts' back to the model's dtype); with a sliding window the int8
    kernel takes all."""
    step = _attention_step(query_lens, context_lens, torch.float32, seed=13, h=9, kvh=3, d=64)
    cache, meta, qkv = step
    step = (quantize(cache), meta, tuple(x.to(dtype) for x in qkv))
    flag = "kernel_prompts_amx" if kind == "amx" else "kernel_prompts_f32"
    m = torch.rand(3, 32, generator=torch.Generator().manual_seed(2)).add(0.5).repeat(1, 2)

    def run(use_kernel):
        return _run_attention_layer(
            step,
            use_kernel,
            sliding_window=window,
            key_scale=m if key_scale else None,
            kernel_long_queries_int8=True,
            **{flag: True},
        )

    ref = run(False)
    name = "paged_prefill_attention_amx" if kind == "amx" else "paged_prefill_attention"
    op, paged = getattr(torch.ops.fastforward, name), torch.ops.fastforward.paged_attention
    prompt_calls, paged_calls = [], []

    def prompt_kernel(q, cache_, *args):
        prompt_calls.append((cache_.dtype, args[1].tolist()))
        return op(q, cache_, *args)

    monkeypatch.setattr(torch.ops.fastforward, name, prompt_kernel)
    monkeypatch.setattr(
        torch.ops.fastforward,
        "paged_attention",
        lambda q, *a: paged_calls.append(q.shape[0]) or paged(q, *a),
    )
    out = run(True)
    decode_rows = sum(n for n in query_lens if n <= 16)
    if window is None:
        chunks = [0, *torch.tensor([n for n in query_lens if n > 16]).cumsum(0).tolist()]
        assert prompt_calls == [(dtype, chunks)]
        assert paged_calls == ([decode_rows] if decode_rows else [])
    else:
        assert not prompt_calls and paged_calls == [sum(query_lens)]
    # bf16: the dequantized keys rounded (2^-9), then the output (2^-9); float32: the order of
    # the sums, and the int8 kernel's int16 steps of queries and weights where it takes rows
    int8_rows = INT8_DP and (window is not None or decode_rows > 0)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-3 if int8_rows else 2e-5
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_int8_cache_prompts_leave_the_long_query_path_to_a_prompt_kernel():
    """Where a prompt kernel takes an int8 cache's prompt chunks dequantized, the int8 kernel
    does not claim long query runs (so the fused decoder stack leaves prefill steps to the
    module path); without one, or with a sliding window, it does."""
    from fastforward.layers.attention import Attention

    layer = Attention(9, 3, 64, 0.125)
    layer.kv_cache, layer.kv_scales = quantize(torch.zeros(2, 1, 16, 3, 64))
    layer.use_kernel = layer.kernel_long_queries_int8 = True
    assert layer.takes_long_queries(torch.bfloat16)
    layer.kernel_prompts_f32 = True
    assert not layer.takes_long_queries(torch.bfloat16)
    assert not layer.takes_long_queries(torch.float32)
    layer.sliding_window = 20
    assert layer.takes_long_queries(torch.bfloat16)


def test_bf16_prompts_in_place_only_for_plain_causal_attention_over_a_float_cache():
    """A float cache's prompt chunks go to a prompt kernel over the cache as it is only where
    one exists for the queries' dtype, the cache has that dtype, and attention is plain causal
    (no window, softcap or key scale); never for an int8 cache (dequantized instead)."""
    from fastforward.layers.attention import Attention

    layer = Attention(9, 3, 64, 0.125)
    layer.kv_cache = torch.zeros(2, 1, 16, 3, 64, dtype=torch.bfloat16)
    layer.use_kernel = True
    assert not layer.prompts_in_place(torch.bfloat16)  # no prompt kernel
    layer.kernel_prompts_f32 = True
    assert layer.prompts_in_place(torch.bfloat16)
    assert not layer.prompts_in_place(torch.float32)  # the cache is bf16
    layer.sliding_window = 20
    assert not layer.prompts_in_place(torch.bfloat16)
    layer.sliding_window, layer.softcap = None, 30.0
    assert not layer.prompts_in_place(torch.bfloat16)
    layer.softcap = None
    layer.set_key_channel_scale(torch.ones(3, 64))
    assert not layer.prompts_in_place(torch.bfloat16)
    layer.set_key_channel_scale(None)
    layer.kv_cache, layer.kv_scales = quantize(torch.zeros(2, 1, 16, 3, 64))
    assert not layer.prompts_in_place(torch.bfloat16)
    assert layer.prompts_dequantized(torch.bfloat16)


def test_blocks_read_renumbers_the_tables():
    """Each sequence's used blocks in table order (a shared block twice), the tables
    renumbered to that list; padding stays 0."""
    from fastforward.layers.attention import blocks_read

    tables = torch.tensor([[7, 3, 9], [7, 5, 0], [4, 0, 0]])
    blocks, renumbered = blocks_read(tables, torch.tensor([33, 17, 1]), 16)
    assert blocks.tolist() == [7, 3, 9, 7, 5, 4]
    assert renumbered.tolist() == [[0, 1, 2], [3, 4, 0], [5, 0, 0]]
    assert torch.equal(blocks[renumbered[tables != 0]], tables[tables != 0])


@needs_amx
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("seqs", [5, 24])  # a few (items one by one) or many (whole groups)
def test_paged_prefill_attention_amx_equals_one_sequence_at_a_time(block_size, seqs):
    """The prompts of a step over the paged cache (contexts of 0-70 keys, a sequence with no
    queries, shuffled blocks) equal prefill_attention_amx over each sequence's keys, bit for
    bit; bad metadata is rejected."""
    g = torch.Generator().manual_seed(seqs + block_size)
    tq = [[40, 0, 17, 1, 33][i % 5] for i in range(seqs)]
    ctx = [[0, 5, 70, 69, 0][i % 5] for i in range(seqs)]
    cache, meta = _random_batch(tq, ctx, 3, 64, block_size, torch.bfloat16, seed=seqs)
    q = torch.randn(sum(tq), 9, 64, generator=g).to(torch.bfloat16)
    table = meta.groups[0].block_tables
    ops = kernels.ops()
    out = ops.paged_prefill_attention_amx(
        q, cache, table, meta.query_start_loc, meta.seq_lens, 0.125
    )
    qs = meta.query_start_loc.tolist()
    for b in range(seqs):
        if tq[b]:
            n = tq[b] + ctx[b]
            blocks = table[b, : -(-n // block_size)]
            k, v = (cache[i][blocks].flatten(0, 1)[:n] for i in range(2))
            one = ops.prefill_attention_amx(q[qs[b] : qs[b + 1]], k, v, 0.125)
            assert torch.equal(out[qs[b] : qs[b + 1]], one)
    args = (table, meta.query_start_loc, meta.seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="more queries than keys"):
        ops.paged_prefill_attention_amx(
            q, cache, table, meta.query_start_loc, meta.query_lens - 1, 0.125
        )
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.paged_prefill_attention_amx(q, cache, table + cache.shape[1], *args[1:])
    with pytest.raises(RuntimeError, match="bf16"):
        ops.paged_prefill_attention_amx(q.float(), cache, *args)
    with pytest.raises(RuntimeError, match="run from 0"):
        ops.paged_prefill_attention_amx(q[1:], cache, *args)


@needs_amx
def test_prefill_attention_amx_rejects_bad_input():
    ops = kernels.ops()
    q = torch.randn(4, 2, 64).to(torch.bfloat16)
    k = torch.randn(8, 1, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.prefill_attention_amx(q.float(), k, k, 0.1)
    with pytest.raises(RuntimeError, match="fewer keys"):
        ops.prefill_attention_amx(q, k[:3], k[:3], 0.1)
    with pytest.raises(RuntimeError, match="head_dim"):
        ops.prefill_attention_amx(q[..., :48], k[..., :48], k[..., :48], 0.1)
    with pytest.raises(RuntimeError, match="KV heads"):
        ops.prefill_attention_amx(
            q[:, :1].expand(4, 3, 64), k.expand(8, 2, 64), k.expand(8, 2, 64), 0.1
        )


def test_reference_causal_sdpa_equals_masked(monkeypatch):
    """Fresh prompts of different lengths (padded among themselves) take SDPA's causal mode in
    the reference path: the same numbers as the explicit mask."""
    from fastforward.attention import reference

    cache, meta = _random_batch([37, 12, 5], [0, 0, 0], 3, 64, 16, torch.float32, seed=1)
    q = torch.randn(54, 9, 64)
    args = dict(scale=0.125)
    causal = reference.paged_attention(q, cache, meta, meta.groups[0], **args)
    assert meta.derived["no_context"] and ("mask", None) not in meta.derived
    monkeypatch.setattr(reference, "no_context", lambda meta: False)
    meta.derived.clear()
    masked = reference.paged_attention(q, cache, meta, meta.groups[0], **args)
    torch.testing.assert_close(causal, masked, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("rows", "head_dim", "message"), [(2, 16, "query_start_loc"), (3, 8, "head_dim")]
)
def test_paged_attention_rejects_inconsistent_metadata(rows, head_dim, message):
    cache, meta = _random_batch([3], [5], 2, 16, 16, torch.float32, seed=0)
    group = meta.groups[0]
    with pytest.raises(RuntimeError, match=message):
        kernels.ops().paged_attention(
            torch.randn(rows, 4, head_dim),
            cache,
            group.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            0.25,
            0,
            0.0,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_matches_module(dtype, unit_offset):
    from fastforward.layers.norm import RMSNorm

    norm = RMSNorm(72, 1e-6, unit_offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(72))
    norm = norm.to(dtype)
    x = (torch.randn(2, 5, 72) * 3).to(dtype)
    ref = norm(x)
    norm.use_kernel = True
    out = norm(x)
    assert out.dtype == dtype and out.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    view = torch.randn(4, 3 * 72).to(dtype)[:, 72:144]  # rows with a stride
    torch.testing.assert_close(
        norm(view).float(), ref.new_tensor(0).float() + _ref_norm(norm, view)
    )


def _ref_norm(norm, x):
    norm.use_kernel = False
    try:
        return norm(x).float()
    finally:
        norm.use_kernel = True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_activation_matches_module(dtype, act):
    from fastforward.layers.activation import GatedActivation

    layer = GatedActivation(act)
    x = (torch.randn(7, 2 * 83) * 4).to(dtype)
    ref = layer(x)
    layer.use_kernel = True
    out = layer(x)
    assert out.dtype == dtype and out.shape == (7, 83)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wdtype", ["x", torch.float32])
@pytest.mark.parametrize("dim", [576, 83])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, wdtype, dim):
    ops = kernels.ops()
    gen = torch.Generator().manual_seed(dim)
    x = (torch.randn(7, dim, generator=gen) * 3).to(dtype)
    d = (torch.randn(7, dim, generator=gen) * 3).to(dtype)
    w = (torch.rand(dim, generator=gen) + 0.5).to(dtype if wdtype == "x" else wdtype)
    want_x = x + d
    want = ops.rms_norm(want_x, w, 1e-5, False)
    got = ops.add_rms_norm_(x, d, w, 1e-5, False)
    assert torch.equal(x, want_x)  # updated in place, rounded as x + d
    assert torch.equal(got, want)


def test_add_rms_norm_rejects_bad_input():
    ops = kernels.ops()
    x, w = torch.zeros(3, 8), torch.ones(8)
    with pytest.raises(RuntimeError, match="one shape"):
        ops.add_rms_norm_(x, torch.zeros(3, 7), w, 1e-5, False)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.add_rms_norm_(x, torch.zeros(3, 8, dtype=torch.bfloat16), w, 1e-5, False)
    with pytest.raises(RuntimeError, match="8 entries"):
        ops.add_rms_norm_(x, torch.zeros(3, 8), torch.ones(5), 1e-5, False)


@pytest.mark.parametrize("vocab", [1, 5, 31, 32, 33, 100, 49152])
def test_argmax_rows_matches_torch_max(vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=gen)
    if vocab > 1:
        x[1] = torch.randint(0, 3, (vocab,), generator=gen).float()  # many ties: the first wins
        x[2, vocab // 2] = float("nan")  # a NaN is the pick (torch.max's)
        x[2, -1] = float("nan")
        x[3] = float("-inf")
        x[4, -1] = 1e9  # in the scalar tail
        x[5] = 0.0
        x[5, vocab // 3] = -0.0  # -0 == 0: the first one
        x[6, 0] = float("nan")
    ops = kernels.ops()
    got = ops.argmax_rows(x)
    assert got.dtype == torch.int64
    assert got.tolist() == x.max(dim=-1).indices.tolist()
    assert ops.argmax_rows(x[:, : max(1, vocab // 2)]).tolist() == (
        x[:, : max(1, vocab // 2)].max(dim=-1).indices.tolist()  # a strided view
    )


@pytest.mark.parametrize("vocab", [1, 7, 16, 33, 1000, 49152])
def test_sample_logits_picks_the_token_whose_interval_holds_u(vocab):
    """The kernel samples softmax(logits) by inverse CDF: a uniform in the middle of a token's
    interval of the CDF (computed in float64) picks that token, as the torch twin does; masked
    tokens are never picked; rows without finite mass give -1."""
    from fastforward.layers.sampler import inverse_cdf

    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=gen) * 3
    x[1, ::3] = float("-inf")  # masked tokens
    x[1, 0] = 0.0
    x[2] = -1e4
    x[2, -1] = 5.0  # one token takes all the mass (the others under e^-87)
    if vocab > 1:
        x[4, vocab // 2] = float("nan")
    x[5] = float("-inf")
    ops = kernels.ops()
    probs = torch.softmax(x.double(), dim=-1)
    cdf = probs.cumsum(dim=-1)
    for r in (0, 1, 2, 3):
        big = torch.nonzero(probs[r] > 1e-3).flatten()[:40].tolist()
        for j in big:
            lo = cdf[r, j - 1].item() if j else 0.0
            u = torch.full((6,), (lo + cdf[r, j].item()) / 2, dtype=torch.float64)
            assert ops.sample_logits(x, u)[r].item() == j
            assert inverse_cdf(torch.softmax(x, dim=-1), u)[r].item() == j
    picks = set()
    for u in torch.linspace(0, 1 - 1e-12, 257, dtype=torch.float64).tolist():
        got = ops.sample_logits(x, torch.full((6,), u, dtype=torch.float64))
        picks.add(got[1].item())
        assert got[5].item() == -1  # all masked
        assert got[4].item() == (-1 if vocab > 1 else 0)  # a NaN row
        assert got[2].item() == vocab - 1
    assert all(x[1, j] > float("-inf") for j in picks)
    assert len(picks) > 1 or vocab < 4  # it really samples


def test_sample_logits_rejects_bad_input():
    ops = kernels.ops()
    u = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="2-D float32"):
        ops.sample_logits(torch.zeros(3, 4, dtype=torch.bfloat16), u)
    with pytest.raises(RuntimeError, match="one value per row"):
        ops.sample_logits(torch.zeros(3, 4), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="float64"):
        ops.sample_logits(torch.zeros(3, 4), torch.zeros(3))
    with pytest.raises(RuntimeError, match="empty"):
        ops.sample_logits(torch.zeros(3, 0), u)


def test_argmax_rows_rejects_bad_input():
    ops = kernels.ops()
    with pytest.raises(RuntimeError, match="2-D float32"):
        ops.argmax_rows(torch.zeros(3, 4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="empty"):
        ops.argmax_rows(torch.zeros(3, 0))
    assert ops.argmax_rows(torch.zeros(0, 7)).shape == (0,)


def test_engine_sampler_takes_the_kernel_argmax(tiny_model_dir, monkeypatch):
    from fastforward import LLM, SamplingParams

    directory, _ = tiny_model_dir("llama")
    # the greedy screen would pick these two rows' tokens without logits (test_greedy_screen.py)
    llm = LLM(str(directory), kernels="native", greedy_screen=False, download_progress=False)
    calls = []
    original = llm.engine.sampler._argmax
    monkeypatch.setattr(
        llm.engine.sampler, "_argmax", lambda x: calls.append(x.shape) or original(x)
    )
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm.generate([list(range(5, 30)), list(range(3, 9))], params, use_tqdm=False)
    assert calls and all(len(c) == 2 for c in calls)
    plain = LLM(str(directory), kernels="torch", download_progress=False)
    assert plain.engine.sampler._argmax is None


def test_engine_kernel_modes(tiny_model_dir):
    from fastforward import LLM, SamplingParams
    from fastforward.kernels.linear import PackedLinear

    directory, _ = tiny_model_dir("llama")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = list(range(5, 30))
    native = LLM(str(directory), dtype="bfloat16", kernels="native", download_progress=False)
    report = native.engine.kernels
    assert report.mode == "native" and report.attention_layers > 0 and report.linears
    assert any(isinstance(m, PackedLinear) for m in native.engine.model.modules())
    torch_llm = LLM(str(directory), dtype="bfloat16", kernels="torch", download_progress=False)
    assert torch_llm.engine.kernels.mode == "torch" and "torch" in torch_llm.engine.kernels.reason
    a = native.generate([prompt], params)[0].outputs[0].token_ids
    b = torch_llm.generate([prompt], params)[0].outputs[0].token_ids
    assert a[:4] == b[:4]  # bf16 roundings differ; the first tokens of a greedy run agree
    with pytest.raises(ValueError, match="kernels="):
        LLM(str(directory), kernels="fast", download_progress=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rope_in_place_matches_reference(dtype, partial):
    from fastforward.layers.rotary import RotaryEmbedding
    from fastforward.models.config import RopeConfig

    rope = RotaryEmbedding(32, RopeConfig(theta=10000.0, partial_rotary_factor=partial), 64)
    qkv = torch.randn(6, (4 + 2 + 2) * 32).to(dtype)
    q, k, _ = qkv.split([128, 64, 64], dim=-1)  # strided views, as the fused projection gives
    q, k = q.view(6, 4, 32), k.view(6, 2, 32)
    positions = torch.tensor([0, 1, 2, 40, 41, 63])
    ref_q, ref_k = rope(positions, q.clone(), k.clone())
    out_q, out_k = rope.rotate_in_place(positions, q, k, num_positions=64)
    assert out_q.data_ptr() == q.data_ptr()  # rotated in place inside qkv
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out_q.float(), ref_q.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(out_k.float(), ref_k.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_int8_cache_matches_reference(case, q_dtype):
    """An int8 cache with per-(token, head) scales: the kernel dequantizes in place what the
    reference path gathers and dequantizes."""
    query_lens, context_lens, h, kvh, d, window, softcap = case
    dense, meta = _random_batch(query_lens, context_lens, kvh, d, 16, torch.float32, seed=d)
    g = torch.Generator().manual_seed(d + len(query_lens))
    cache, scales = quantize(dense * torch.rand(dense.shape[:-1], generator=g)[..., None] * 4)
    q = torch.randn(sum(query_lens), h, d, generator=g).to(q_dtype)
    group = meta.groups[0]
    kwargs = {"scale": d**-0.5, "window": window, "softcap": softcap}
    ref = paged_attention(q.float(), cache, meta, group, **kwargs, kv_scales=scales)
    dequantized = dequantize(cache, scales, torch.float32)
    torch.testing.assert_close(ref, paged_attention(q.float(), dequantized, meta, group, **kwargs))
    out = kernels.ops().paged_attention(
        q,
        cache,
        group.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        d**-0.5,
        window or 0,
        softcap or 0.0,
        scales,
    )
    assert out.dtype == q_dtype and out.shape == q.shape
    # the int8 path sums in int32: each query row and each row's softmax weights as int16 steps
    # of one scale, else in fp32
    tol = 1e-2 if q_dtype == torch.bfloat16 else 1e-3 if INT8_DP and d % 2 == 0 else 2e-5
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_paged_attention_follows_a_rising_max(kv):
    """Scores that climb in steps along the keys, some by less than the kernel's lazy max lets
    pass (8) and some by more, so the running max stays put, then moves and rescales: the same
    softmax as the reference."""
    query_lens, context_lens, bs, d = [1, 1, 3], [700, 260, 330], 16, 64
    dense, meta = _random_batch(query_lens, context_lens, 3, d, bs, torch.float32, seed=5)
    table = meta.groups[0].block_tables
    steps = [(0, 0.0), (100, 5.0), (203, 17.0), (300, 2.0), (301, 9.5), (407, 30.0), (650, 4.0)]
    for i, n in enumerate(meta.seq_lens.tolist()):
        for p in range(n):
            score = [v for start, v in steps if start <= p][-1]
            dense[0, table[i, p // bs], p % bs, :, 0] = score  # q = 8 e0, scale 1/8: score = k0
    q = torch.zeros(sum(query_lens), 9, d)
    q[..., 0] = 8.0
    if kv == "int8":
        cache, scales = quantize(dense)
        extra = (scales,)
    else:
        cache, scales, extra, q = dense.bfloat16(), None, (), q.bfloat16()
    group = meta.groups[0]
    ref = paged_attention(
        q.float(),
        cache.float() if scales is None else cache,
        meta,
        group,
        scale=d**-0.5,
        kv_scales=scales,
    )
    out = kernels.ops().paged_attention(
        q, cache, group.block_tables, meta.query_start_loc, meta.seq_lens, d**-0.5, 0, 0.0, *extra
    )
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_paged_attention_int8_cache_needs_scales():
    dense, meta = _random_batch([1], [5], 2, 16, 16, torch.float32, seed=0)
    cache, scales = quantize(dense)
    group = meta.groups[0]
    args = (group.block_tables, meta.query_start_loc, meta.seq_lens, 0.25, 0, 0.0)
    with pytest.raises(RuntimeError, match="needs kv_scales"):
        kernels.ops().paged_attention(torch.randn(1, 4, 16), cache, *args)
    with pytest.raises(RuntimeError, match="float16"):
        kernels.ops().paged_attention(torch.randn(1, 4, 16), cache, *args, scales.float())


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_write_kv_equals_reference(x_dtype, cache_dtype):
    """The fused write stores exactly what the reference write stores (int8 codes and float16
    scales included), from strided k/v views like the ones a fused QKV projection gives."""
    torch.manual_seed(0)
    qkv = torch.randn(11, 3, 2, 40).to(x_dtype) * torch.logspace(-2, 2, 11)[:, None, None, None]
    qkv[4, :, 1] = 0.0
    k, v = qkv[:, 1], qkv[:, 2]  # [T, KVH, D], token stride 240
    slots = torch.randperm(6 * 4)[:11]
    shape = (2, 6, 4, 2, 40)
    caches = []
    for write in (write_kv, kernels.ops().write_kv):
        cache = torch.zeros(shape, dtype=cache_dtype)
        scales = torch.zeros(shape[:-1], dtype=torch.float16) if cache_dtype == torch.int8 else None
        write(cache, k, v, slots, scales)
        caches.append((cache, scales))
    (ref, ref_scales), (out, out_scales) = caches
    assert torch.equal(out, ref)
    if cache_dtype == torch.int8:
        assert torch.equal(out_scales, ref_scales) and out.abs().max() == 127


def test_write_kv_rejects_bad_slots():
    cache = torch.zeros(2, 3, 4, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.ops().write_kv(
            cache, torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.tensor([12])
        )
    with pytest.raises(RuntimeError, match="needs contiguous float16 kv_scales"):
        kernels.ops().write_kv(
            cache.to(torch.int8), torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.tensor([1])
        )


@pytest.mark.parametrize(("rows", "vocab", "k"), [(5, 1000, 16), (3, 37, 4), (2, 16, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_rescore_logits_recomputes_each_rows_top_k_in_fp32(rows, vocab, k, bias):
    g = torch.Generator().manual_seed(vocab + k)
    x = torch.randn(rows, 72, generator=g).to(torch.bfloat16)
    w = torch.randn(vocab, 72, generator=g).to(torch.bfloat16)
    b = torch.randn(vocab, generator=g) if bias else None
    y = (x.float() @ w.float().t()).to(torch.bfloat16)  # oneDNN's bf16-rounded logits
    y[0, :8] = y[0].max()  # ties at the top: the earliest are kept
    out = kernels.ops().rescore_logits(y, x, w, b, k)
    coarse = y.float() + (b if bias else 0)
    exact = x.double() @ w.double().t() + (b.double() if bias else 0)
    for r in range(rows):
        # the k largest coarse logits, the earliest first among equals (a stable sort)
        top = torch.sort(coarse[r], descending=True, stable=True).indices[:k]
        rest = torch.ones(vocab, dtype=torch.bool)
        rest[top] = False
        assert torch.equal(out[r, rest], coarse[r, rest])
        torch.testing.assert_close(out[r, top].double(), exact[r, top], rtol=1e-5, atol=1e-5)
        assert not torch.equal(out[r, top], coarse[r, top])


@pytest.mark.parametrize("arch", ["llama", "llama3-rope-tied"])
@pytest.mark.parametrize("rows", [3, 40])
def test_packed_output_projection_returns_fp32_logits(tiny_model_dir, arch, rows):
    """Decode-sized batches get the head's fp32 accumulators, not logits rounded to bf16;
    larger ones (oneDNN's bf16 matmul) get their top RESCORE_TOP logits recomputed in fp32."""
    from fastforward import LLM
    from fastforward.kernels.linear import RESCORE_TOP

    directory, _ = tiny_model_dir(arch)
    llm = LLM(str(directory), dtype="bfloat16", kernels="native", download_progress=False)
    model = llm.engine.model
    hidden = torch.randn(rows, model.config.hidden_size).to(torch.bfloat16)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    weight = model.lm_head.weight.double()  # the tied head packs the embedding matrix
    ref = hidden.double() @ weight.t()
    if rows > model.lm_head.packed_rows_max:
        top = ref.topk(RESCORE_TOP // 2, dim=-1).indices
        ref, logits = ref.gather(-1, top), logits.gather(-1, top)
    err = (logits.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-5  # a bf16 rounding of the logits would leave ~2e-3
