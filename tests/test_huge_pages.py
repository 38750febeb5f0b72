"""Weights gathered into one buffer of 2 MiB pages (fastforward/huge_pages.py): the model computes
exactly what it did, shared storages stay shared, and the engine option switches it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fastforward import LLM, SamplingParams
from fastforward.huge_pages import (
    HUGE_PAGE,
    gather_weights,
    huge_page_buffer,
    huge_pages_supported,
    mapped_huge_page_bytes,
)

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
    ],
)
def test_engine_output_is_unchanged(tiny_model_dir, arch, kw):
    directory, _ = tiny_model_dir(arch)
    paged, with_pages = _generate(directory, True, **kw)
    runner = paged.engine.runner
    assert runner.huge_pages is not None, runner.huge_pages_reason
    assert runner.huge_pages.tensors > 0 and runner.huge_pages.nbytes > 0
    plain, without = _generate(directory, False, **kw)
    assert plain.engine.runner.huge_pages is None
    assert plain.engine.runner.huge_pages_reason == "huge_pages=False"
    assert with_pages == without
