"""Weights gathered into one buffer of 2 MiB pages and the KV cache allocated in another
(fastforward/huge_pages.py): the model computes exactly what it did, shared storages stay shared,
and the engine option switches both."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fastforward import LLM, SamplingParams
from fastforward.huge_pages import (
    ALIGN,
    HUGE_PAGE,
    gather_weights,
    huge_page_buffer,
    huge_page_zeros,
    huge_pages_supported,
    mapped_huge_page_bytes,
)
from fastforward.kernels.linear import onednn_prepack

pytestmark = pytest.mark.skipif(not huge_pages_supported(), reason="no MADV_HUGEPAGE here")

PROMPTS = [list(range(5, 12)), list(range(20, 47)), list(range(3, 9))]


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "unknown"


def test_buffer_is_aligned_zeroed_and_backed():
    buf = huge_page_buffer(3 * HUGE_PAGE + 100)
    assert buf.numel() == 3 * HUGE_PAGE + 100 and buf.dtype == torch.uint8
    assert buf.data_ptr() % HUGE_PAGE == 0
    assert int(buf.count_nonzero()) == 0
    buf.fill_(7)  # touched: the kernel backs it now
    backed = mapped_huge_page_bytes(buf)
    if _thp_mode() in ("always", "madvise") and backed is not None:
        assert backed >= HUGE_PAGE, f"THP is {_thp_mode()} but no huge page backs the buffer"


def test_zeros_are_separate_aligned_tensors_in_one_backed_buffer():
    layout = [((2, 3, 16, 5), torch.bfloat16), ((7,), torch.float16), ((2, 300, 4), torch.int8)]
    tensors, placed = huge_page_zeros(layout)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == layout
    assert placed.tensors == 3 and placed.nbytes >= sum(t.nbytes for t in tensors)
    assert all(t.data_ptr() % ALIGN == 0 and int(t.count_nonzero()) == 0 for t in tensors)
    ends = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    assert all(e <= s for (_, e), (s, _) in zip(ends, ends[1:], strict=False))  # no overlap
    assert ends[-1][1] - ends[0][0] <= placed.nbytes  # all in the one buffer
    tensors[1].fill_(3.0)  # writing one leaves the others zero
    assert int(tensors[0].count_nonzero()) == 0 and int(tensors[2].count_nonzero()) == 0
    if _thp_mode() in ("always", "madvise") and placed.huge_page_bytes is not None:
        assert placed.huge_page_bytes > 0, f"THP is {_thp_mode()} but no huge page backs it"


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 48, bias=False)
        self.b = nn.Linear(64, 48, bias=False)
        self.b.weight = self.a.weight  # tied: one storage, two modules
        self.register_buffer("table", torch.randn(100, 8))
        self.rows = self.table[:10]  # a view: its storage must stay where it is
        self.extra = torch.arange(1000, dtype=torch.int32)  # a plain tensor attribute
        self.kv_cache = torch.zeros(4, 4)  # state, never moved
        # oneDNN's prepacked copy of a weight (PackedLinear.onednn on a CPU with AVX512-BF16
        # and no AMX): an opaque tensor with no storage to move; it must stay usable
        self.onednn = onednn_prepack(torch.randn(48, 64).bfloat16())


def test_gather_keeps_values_and_sharing():
    torch.manual_seed(0)
    m = _Shared()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    table_ptr, kv_ptr = m.table.data_ptr(), m.kv_cache.data_ptr()
    x = torch.randn(3, 64)
    y = m.a(x) + m.b(x)
    g = gather_weights(m)
    assert g.tensors == 3 and g.nbytes >= (64 * 48 * 4 + 4000)  # a/b weight (twice), extra
    assert m.a.weight is m.b.weight or m.a.weight.data_ptr() == m.b.weight.data_ptr()
    assert isinstance(m.a.weight, nn.Parameter)
    assert m.table.data_ptr() == table_ptr and m.rows.data_ptr() == table_ptr
    assert m.kv_cache.data_ptr() == kv_ptr
    moved = {m.a.weight.untyped_storage().data_ptr(), m.extra.untyped_storage().data_ptr()}
    assert len(moved) == 1, "moved tensors should share the one buffer"
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(m.extra, torch.arange(1000, dtype=torch.int32))
    assert torch.equal(m.a(x) + m.b(x), y)
    if m.onednn is not None:  # None only where this PyTorch has no oneDNN
        assert m.onednn.is_mkldnn and m.onednn.to_dense().shape == (48, 64)
    assert gather_weights(m).tensors == 0  # views into the buffer stay put


def _generate(directory, huge_pages: bool, **kw):
    llm = LLM(str(directory), huge_pages=huge_pages, download_progress=False, **kw)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    got = [
        (
            o.outputs[0].token_ids,
            [sorted((k, v.logprob) for k, v in d.items()) for d in o.outputs[0].logprobs],
        )
        for o in outs
    ]
    return llm, got


@pytest.mark.parametrize(
    "arch,kw",
    [
        ("llama3-rope-tied", {}),
        ("llama3-rope-tied", {"kernels": "torch"}),
        ("qwen2", {"quantization": "int8"}),
        ("qwen2", {"kv_cache_dtype": "int8"}),
    ],
)
def test_engine_output_is_unchanged(tiny_model_dir, arch, kw):
    directory, _ = tiny_model_dir(arch)
    paged, with_pages = _generate(directory, True, **kw)
    runner = paged.engine.runner
    assert runner.huge_pages is not None, runner.huge_pages_reason
    assert runner.huge_pages.tensors > 0 and runner.huge_pages.nbytes > 0
    # the KV cache (and an int8 cache's scales) in one huge-page buffer
    kv = [t for t in runner.kv_caches + runner.kv_scales if t is not None]
    assert runner.kv_huge_pages is not None, runner.kv_huge_pages_reason
    assert (
        runner.kv_huge_pages.tensors
        == len(kv)
        == len(runner.kv_caches) * (2 if kw.get("kv_cache_dtype") == "int8" else 1)
    )
    lo = min(t.data_ptr() for t in kv)
    assert max(t.data_ptr() + t.nbytes for t in kv) - lo <= runner.kv_huge_pages.nbytes
    plain, without = _generate(directory, False, **kw)
    assert plain.engine.runner.huge_pages is None
    assert plain.engine.runner.huge_pages_reason == "huge_pages=False"
    assert plain.engine.runner.kv_huge_pages is None
    assert plain.engine.runner.kv_huge_pages_reason == "huge_pages=False"
    assert with_pages == without
