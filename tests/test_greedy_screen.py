"""The greedy screen (layers/greedy_screen.py, csrc/greedy_screen.cpp): plain greedy steps of a
few sequences pick their tokens through an int8 copy of the output projection -- the argmax of
the very logits the full projection gives, ties and all, or the full projection where the screen
cannot decide."""

from __future__ import annotations

import pytest
import torch

from fastforward import LLM, SamplingParams, kernels
from fastforward.layers.greedy_screen import GreedyScreen
from fastforward.layers.sampler import Sampler, plain_greedy
from fastforward.request import Request

pytestmark = pytest.mark.skipif(
    not (kernels.available() and kernels.ops().greedy_screen_native()),
    reason="no AVX512-BF16 / VNNI kernels",
)


def _full_argmax(x: torch.Tensor, tiles: torch.Tensor, n: int) -> torch.Tensor:
    ops = kernels.ops()
    return ops.argmax_rows(ops.linear_amx(x, tiles, n, None, True))


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)


@pytest.mark.parametrize(("n", "k"), [(1000, 70), (4096, 576), (333, 64)])
def test_screen_picks_the_full_projections_argmax(n, k):
    # n not a multiple of 16 (a part block), k not of 4 or 32 (padded quads and tiles)
    ops = kernels.ops()
    w = _weights(n, k, seed=n)
    tiles, packed = ops.pack_amx_weight(w), ops.greedy_screen_pack(w)
    g = torch.Generator().manual_seed(k)
    decided = total = 0
    for m in (1, 2, 3, 8):
        for _ in range(10):
            x = torch.randn(m, k, generator=g) * 3
            x[:, :3] *= 30  # outlier channels, as real hidden states have
            x = x.to(torch.bfloat16)
            got = ops.greedy_screen(x, packed, tiles, n, 512)
            want = _full_argmax(x, tiles, n)
            for row in range(m):
                total += 1
                if int(got[row]) >= 0:
                    decided += 1
                    assert int(got[row]) == int(want[row])
    assert decided == total  # random logits spread wide: every row decided


def test_exact_ties_go_to_the_first_row_as_argmax():
    ops = kernels.ops()
    n, k = 700, 96
    w = _weights(n, k, seed=3)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    top = (x[0].float() / x[0].float().norm()).to(torch.bfloat16)
    for i in (650, 17, 402):  # the same largest logit three times, the first at 17
        w[i] = top
    tiles, packed = ops.pack_amx_weight(w), ops.greedy_screen_pack(w)
    assert int(_full_argmax(x, tiles, n)[0]) == 17
    assert int(ops.greedy_screen(x, packed, tiles, n, 512)[0]) == 17


def test_rows_the_int8_copy_cannot_tell_apart_are_decided_by_their_exact_logits():
    ops = kernels.ops()
    n, k = 300, 64
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    top = (x[0].float() / x[0].float().norm()).to(torch.bfloat16)
    # one element of a copy of the largest row a bf16 step further along x: a larger logit,
    # the same int8 codes (not the row's largest element, which sets its scale)
    for j in x[0].float().abs().argsort(descending=True)[1:].tolist():
        nudged = top.clone()
        nudged[j] = torch.nextafter(top[j].float(), top[j].float() * 2).to(torch.bfloat16)
        if nudged[j] == top[j]:
            nudged[j] = (top[j].float() * (1 + 2**-7)).to(torch.bfloat16)
        w = _weights(n, k, seed=7)
        w[100], w[200] = top, nudged  # the larger logit second
        tiles, packed = ops.pack_amx_weight(w), ops.greedy_screen_pack(w)
        codes = packed[0].permute(0, 2, 1, 3).reshape(-1, packed[0].shape[1] * 4)
        if torch.equal(codes[100], codes[200]) and int(_full_argmax(x, tiles, n)[0]) == 200:
            break
    else:
        pytest.fail("no element keeps the codes")
    assert float(packed[2][100]) == float(packed[2][200])  # one int8 row for both
    assert int(ops.greedy_screen(x, packed, tiles, n, 512)[0]) == 200


def test_rows_it_cannot_decide_are_left_to_the_full_projection():
    ops = kernels.ops()
    n, k = 512, 64
    w = _weights(n, k, seed=5)
    tiles, packed = ops.pack_amx_weight(w), ops.greedy_screen_pack(w)
    x = torch.randn(2, k).to(torch.bfloat16)
    first = int(_full_argmax(x[:1], tiles, n)[0])
    bad = x.clone()
    bad[1, 3] = float("nan")  # that row only
    assert ops.greedy_screen(bad, packed, tiles, n, 512).tolist() == [first, -1]
    bad[1, 3] = float("inf")
    assert ops.greedy_screen(bad, packed, tiles, n, 512).tolist() == [first, -1]
    assert ops.greedy_screen(x, packed, tiles, n, 0).tolist() == [-1, -1]  # over the limit
    same = w[:1].expand(n, k).contiguous()  # every row the maximum: all candidates
    tiles, packed = ops.pack_amx_weight(same), ops.greedy_screen_pack(same)
    assert ops.greedy_screen(x, packed, tiles, n, 100).tolist() == [-1, -1]
    assert ops.greedy_screen(x, packed, tiles, n, n).tolist() == [0, 0]  # all ties: the first


def test_bad_shapes_are_refused():
    ops = kernels.ops()
    w = _weights(64, 32, seed=6)
    tiles, packed = ops.pack_amx_weight(w), ops.greedy_screen_pack(w)
    with pytest.raises(RuntimeError, match="features"):
        ops.greedy_screen(torch.randn(1, 48).to(torch.bfloat16), packed, tiles, 64, 8)
    with pytest.raises(RuntimeError, match="rows"):
        ops.greedy_screen(torch.randn(9, 32).to(torch.bfloat16), packed, tiles, 64, 8)
    with pytest.raises(RuntimeError, match="N="):
        ops.greedy_screen(torch.randn(1, 32).to(torch.bfloat16), packed, tiles, 100, 8)


def _request(output: list[int] | None = None, grammar=None, **params) -> Request:
    req = Request("r", [3, 4, 5], SamplingParams(**params), eos_token_id=1)
    for t in output or []:
        req.append_token(t)
    req.grammar = grammar
    return req


@pytest.mark.parametrize(
    ("params", "output", "grammar", "plain"),
    [
        ({"temperature": 0}, None, None, True),
        ({"temperature": 0, "min_tokens": 2}, [7, 8], None, True),  # min_tokens reached
        ({"temperature": 0, "stop": ["x"], "seed": 3}, None, None, True),  # logits untouched
        ({"temperature": 0.7}, None, None, False),
        ({"temperature": 0, "logprobs": 1}, None, None, False),
        ({"temperature": 0, "repetition_penalty": 1.2}, None, None, False),
        ({"temperature": 0, "presence_penalty": 0.5}, None, None, False),
        ({"temperature": 0, "frequency_penalty": 0.5}, None, None, False),
        ({"temperature": 0, "dry_multiplier": 0.8}, None, None, False),
        ({"temperature": 0, "min_tokens": 3}, [7], None, False),
        ({"temperature": 0}, None, object(), False),
    ],
)
def test_plain_greedy_is_exactly_the_samplers_plain_argmax(params, output, grammar, plain):
    req = _request(output, grammar, **params)
    assert plain_greedy(req) is plain
    if plain:  # the sampler's pick is the raw logits' argmax, whatever they are
        logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
        reqs = [req] * 4
        picked = [t.token_id for t in Sampler()(logits, reqs)]
        assert picked == logits.argmax(-1).tolist()


PROMPTS = [list(range(5, 10)), list(range(7, 47)), list(range(30, 43))]


@pytest.fixture
def screen_results(monkeypatch):
    """What each call of the screen returned (None: left to the full projection)."""
    results = []
    original = GreedyScreen.__call__

    def recording(self, *args, **kw):
        out = original(self, *args, **kw)
        results.append(None if out is None else out.tolist())
        return out

    monkeypatch.setattr(GreedyScreen, "__call__", recording)
    return results


@pytest.mark.parametrize("arch", ["llama", "llama3-rope-tied"])  # own head, tied embedding
def test_engine_tokens_are_the_same_with_and_without_the_screen(
    tiny_model_dir, arch, screen_results
):
    directory, _ = tiny_model_dir(arch)
    on = LLM(str(directory), kernels="native", dtype="bfloat16", download_progress=False)
    off = LLM(
        str(directory),
        kernels="native",
        dtype="bfloat16",
        greedy_screen=False,
        download_progress=False,
    )
    assert on.engine.runner.greedy_screen is not None, on.engine.runner.greedy_screen_reason
    assert off.engine.runner.greedy_screen is None
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for batch in (PROMPTS[:1], PROMPTS[:2], PROMPTS):  # three rows: over the screen's two
        got = [o.outputs[0].token_ids for o in on.generate(batch, greedy, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in off.generate(batch, greedy, use_tqdm=False)]
        assert got == want
    decided = [r for r in screen_results if r is not None]
    assert decided, "the screen picked no token"
    assert max(len(r) for r in decided) == 2  # one and two rows; never three
    # a request that wants logprobs keeps its steps on the full logits
    screen_results.clear()
    scored = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    out = on.generate(PROMPTS[:1], scored, use_tqdm=False)[0].outputs[0]
    assert not screen_results and len(out.logprobs) == 8


def test_real_model_greedy_tokens_are_the_same(smollm2_path, screen_results):
    prompts = [
        "The history of the Roman Empire",
        "def fibonacci(n):",
        "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    ]
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    texts = {}
    for screen in (True, False):
        llm = LLM(str(smollm2_path), dtype="bfloat16", greedy_screen=screen)
        if screen:
            assert llm.engine.runner.greedy_screen is not None
        # one at a time (one row a step), then two together
        outs = [llm.generate([p], greedy, use_tqdm=False)[0] for p in prompts]
        outs += llm.generate(prompts[:2], greedy, use_tqdm=False)
        texts[screen] = [o.outputs[0].token_ids for o in outs]
        del llm
    assert texts[True] == texts[False]
    assert sum(r is not None for r in screen_results) >= 3 * 47


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"kernels": "torch"}, "not bf16 on the native tiles"),
        ({"kernels": "native", "dtype": "float32"}, "not bf16 on the native tiles"),
        ({"kernels": "native", "greedy_screen": False}, "greedy_screen=False"),
    ],
)
def test_engines_without_the_screen_say_why(tiny_model_dir, kw, reason):
    directory, _ = tiny_model_dir("llama")
    llm = LLM(str(directory), download_progress=False, **kw)
    assert llm.engine.runner.greedy_screen is None
    assert reason in llm.engine.runner.greedy_screen_reason
