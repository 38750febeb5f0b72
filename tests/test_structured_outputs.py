"""Structured outputs: the constraint types, the batched mask, the schema rewrite, errors, and
generations with the real SmolLM2-135M over real SchemaStore schemas that all validate."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from fastforward import LLM, SamplingParams
from fastforward.structured_outputs import (
    StructuredOutputsParams,
    bitmask_to_bool,
    closed_objects,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from schema_corpus import load_corpus, prompt_for  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city"],
        },
    },
    "required": ["name", "age", "role"],
}


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), max_num_seqs=16)


# ---- pure parts --------------------------------------------------------------------------


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="json"):
        StructuredOutputsParams(json=3)
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.kind == "regex"


def test_bitmask_to_bool():
    words = torch.tensor([[0b101, -(2**31)], [-1, 1]], dtype=torch.int32)
    allowed = bitmask_to_bool(words, 40)
    assert allowed.shape == (2, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2]  # bit 31 of word 1 is token 63
    assert allowed[1].nonzero().flatten().tolist() == [*range(32), 32]


def test_closed_objects_keeps_combined_schemas_open():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "definitions": {
            "base": {"properties": {"id": {"type": "string"}}},
            "full": {
                "allOf": [
                    {"$ref": "#/definitions/base"},
                    {"properties": {"n": {"type": "integer"}}},
                ]
            },
        },
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["definitions"]["base"]  # $ref'd from an allOf
    assert "additionalProperties" not in closed["definitions"]["full"]["allOf"][1]
    assert "additionalProperties" not in schema  # the input is not modified
    # every output of the closed schema validates against the original
    jsonschema.validate(
        {"id": "q", "n": 1}, {**schema["definitions"]["full"], "definitions": schema["definitions"]}
    )


# ---- the engine --------------------------------------------------------------------------


def test_every_constraint_kind(llm):
    cases = [
        (
            StructuredOutputsParams(json=PERSON),
            "A user record as JSON:",
            lambda t: jsonschema.validate(json.loads(t), PERSON),
        ),
        (
            StructuredOutputsParams(json=json.dumps(PERSON)),
            "Describe someone:",
            lambda t: jsonschema.validate(json.loads(t), PERSON),
        ),
        (
            StructuredOutputsParams(json_object=True),
            "Some JSON:",
            lambda t: isinstance(json.loads(t), dict) or 1 / 0,
        ),
        (
            StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
            "Phone number:",
            lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t) or 1 / 0,
        ),
        (
            StructuredOutputsParams(choice=["Paris", "London", "Rome"]),
            "The capital of France is",
            lambda t: t in ("Paris", "London", "Rome") or 1 / 0,
        ),
        (
            StructuredOutputsParams(grammar='start: "yes" | "no" " because " /[a-z ]{1,20}/ "."'),
            "Is water wet?",
            lambda t: re.fullmatch(r"yes|no because [a-z ]{1,20}\.", t) or 1 / 0,
        ),
    ]
    for temperature in (0.0, 1.0):
        outs = llm.generate(
            [p for _, p, _ in cases],
            [
                SamplingParams(
                    max_tokens=120, temperature=temperature, seed=3, structured_outputs=so
                )
                for so, _, _ in cases
            ],
        )
        for (so, _, check), out in zip(cases, outs, strict=True):
            c = out.outputs[0]
            if so.kind == "json_object" and c.finish_reason == "length":
                continue  # any-JSON has no bound on string length; a loop is cut, not wrong
            assert c.finish_reason == "stop", (so.kind, c.text)
            check(c.text)


def test_constrained_and_free_requests_share_a_batch(smollm2_path):
    """A free request's tokens are the same alone and beside constrained ones. In fp32: in
    bf16, a 5-token prefill alone and the batch's 15 tokens take different matmul kernels
    (packed vs oneDNN), whose roundings flipped a 0.04-nat greedy near-tie on an AMX Xeon."""
    llm = LLM(str(smollm2_path), dtype="float32", max_num_seqs=16)
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = llm.generate("The history of Rome", free)[0].outputs[0].token_ids
    constrained = SamplingParams(
        max_tokens=80, temperature=0, structured_outputs=StructuredOutputsParams(json=PERSON)
    )
    outs = llm.generate(
        ["A user as JSON:", "The history of Rome", "Another user:"],
        [constrained, free, constrained],
    )
    assert outs[1].outputs[0].token_ids == alone
    for i in (0, 2):
        jsonschema.validate(json.loads(outs[i].outputs[0].text), PERSON)


def test_n_choices_each_follow_the_grammar(llm):
    params = SamplingParams(
        n=4,
        max_tokens=80,
        temperature=1.0,
        seed=7,
        structured_outputs=StructuredOutputsParams(json=PERSON),
    )
    out = llm.generate("A user as JSON:", params)[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), PERSON)


def test_bad_constraints_raise_naming_the_problem(llm):
    cases = [
        ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum"),
        ({"json": {"type": "frobnicate"}}, "frobnicate"),
        ({"json": {"$ref": "#/definitions/missing"}}, "missing"),
        ({"json": "{not json"}, "JSON"),
        ({"regex": "(("}, "unclosed group"),
        ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),  # can't enforce: refused
        ({"grammar": "start: undefined_rule"}, "undefined_rule"),
        # forced text that spells a special token: llguidance offers the token, then refuses it
        ({"regex": r"<\|im_start\|>"}, "no token of this model's vocabulary"),
    ]
    for so, needle in cases:
        with pytest.raises(ValueError, match=re.escape(needle)):
            llm.generate(
                "x", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**so))
            )
    assert not llm.engine.has_unfinished_requests()


def test_real_schemas_all_validate(llm):
    """Generations over real SchemaStore schemas (greedy and sampled): every one that finishes
    parses and validates; few are cut by max_tokens. The full 1,000-generation run is
    ``benchmarks/bench_structured.py``."""
    usable = []
    for item in load_corpus()[::5]:
        try:
            llm.engine.grammars.compile(StructuredOutputsParams(json=item.schema))
            usable.append(item)
        except ValueError:
            pass
    assert len(usable) >= 24
    usable = usable[:24]
    params = [
        SamplingParams(
            max_tokens=192,
            temperature=0.8 * (i % 2),
            seed=i,
            structured_outputs=StructuredOutputsParams(json=s.schema),
        )
        for i, s in enumerate(usable)
    ]
    outs = llm.generate([prompt_for(s) for s in usable], params)
    finished = 0
    for item, out in zip(usable, outs, strict=True):
        c = out.outputs[0]
        if c.finish_reason == "length":
            continue
        finished += 1
        jsonschema.validate(json.loads(c.text), item.schema)
    assert finished >= len(usable) * 2 // 3


# ---- finishing within the budget (finish_reserve) ----------------------------------------


def test_scan_json():
    from fastforward.structured_finish import JsonScan, scan_json

    assert scan_json('{"a": "b') == JsonScan(in_string=True, depth=1)
    assert scan_json('{"a": ["b"') == JsonScan(in_string=False, depth=2)
    assert scan_json('{"a": "x\\"y[') == JsonScan(in_string=True, depth=1)  # escaped quote
    assert scan_json('{"a": "x\\') == JsonScan(in_string=True, escaped=True, depth=1)
    assert scan_json('{"a": "x\\\\"}') == JsonScan(depth=0)  # an escaped backslash, then the end
    assert scan_json('[{"]": "{"}, [') == JsonScan(depth=2)  # brackets in strings don't count
    assert scan_json('[{"a": -1.5e') == JsonScan(depth=2, number=5)
    assert scan_json('[{"a": "-1.5e') == JsonScan(in_string=True, depth=2)


def test_steer_to_finish_prefers_the_shortest_way_out():
    from types import SimpleNamespace

    from fastforward.structured_finish import FinishClasses, steer_to_finish

    texts = ["<eos>", '"', "]", "}", '"}', "abc", "{", ",", "7", '"]}', "["]
    classes = FinishClasses.from_texts(texts, len(texts), eos=0)
    ids = {t: i for i, t in enumerate(texts)}

    def request(text, kind="json", room=8):
        so = SimpleNamespace(kind=kind)
        params = SimpleNamespace(structured_outputs=so, min_tokens=0)
        out = [ids[t] for t in text]
        return SimpleNamespace(
            sampling_params=params,
            output_token_ids=out,
            num_output_tokens=len(out),
            max_tokens=len(out) + room,
            finish_steered=False,
            finish_scan=None,
            grammar=None,
        )

    def picks(req, allowed_texts):
        allowed = torch.zeros(1, len(texts), dtype=torch.bool)
        allowed[0, [ids[t] for t in allowed_texts]] = True
        out = steer_to_finish(allowed, [req], classes)[0]
        return sorted(texts[i] for i in out.nonzero().flatten().tolist())

    # outside a string: brackets first, then quotes, then whatever opens nothing new
    assert picks(request(["{"]), ['"', "}", "abc", ","]) == ["}"]
    assert picks(request(["{"]), ['"', "abc", ","]) == ['"']
    assert picks(request(["{"]), ["abc", ",", "{"]) == ["abc"]
    # inside a string a quote ends it: '"}' and '"]}' close more after it, '}' would be text
    assert picks(request(["{", '"', "abc"]), ["abc", "}", '"', '"}', '"]}']) == ['"', '"]}', '"}']
    # a complete grammar ends at once
    assert picks(request(["{", "}"]), ["<eos>", "abc"]) == ["<eos>"]
    # a short number is the model's to finish (not to follow with another item) while every
    # open bracket can still close after it
    assert picks(request(["{", "[", "7"], room=4), ["7", "]", ","]) == ["7", "]"]
    assert picks(request(["{", "[", "7"], room=3), ["7", "]", ","]) == ["]"]
    # other grammars only get the end
    assert picks(request(["abc"], kind="regex"), ["abc", '"']) == ['"', "abc"]
    req = request(["{"])
    picks(req, ["}", "abc"])
    assert req.finish_steered


def test_finish_window_opens_early_when_deep():
    from types import SimpleNamespace

    from fastforward.structured_finish import FinishClasses, in_finish_window

    texts = ['{"a": [', "1", ", ", "]", "}"]
    classes = FinishClasses.from_texts(texts, len(texts), eos=None)

    def request(ids, max_tokens, reserve=2, kind="json"):
        so = SimpleNamespace(kind=kind, finish_reserve=reserve)
        return SimpleNamespace(
            sampling_params=SimpleNamespace(structured_outputs=so),
            output_token_ids=ids,
            num_output_tokens=len(ids),
            max_tokens=max_tokens,
            finish_scan=None,
        )

    assert not in_finish_window(request([0, 1], 10), classes)
    assert in_finish_window(request([0, 1], 4), classes)  # the reserve
    deep = [0] * 5 + [1]  # ten brackets open: the window is ten tokens longer
    assert in_finish_window(request(deep, 6 + 12), classes)
    assert not in_finish_window(request(deep, 6 + 13), classes)
    assert not in_finish_window(request(deep, 6 + 12, kind="regex"), classes)
    assert not in_finish_window(request(deep, 6 + 1, reserve=0), classes)
    req = request(deep, 100)  # scanned once, then only what is new
    in_finish_window(req, classes)
    req.output_token_ids = deep + [3, 3]
    req.num_output_tokens = 8
    in_finish_window(req, classes)
    assert req.finish_scan.depth == 8 and req.finish_scan.tokens == 8


def test_shortest_match_of_schema_patterns():
    from fastforward.structured_finish import schema_patterns, shortest_match

    schema = {"properties": {"a": {"pattern": "^[^@]+@x$"}, "b": [{"pattern": "a:b"}]}}
    assert schema_patterns(schema) == schema_patterns(json.dumps(schema)) == ["^[^@]+@x$", "a:b"]
    cases = {
        r"^[\S]+@[\S]+\.[\S]{2,}$": "a@a.aa",
        r"https://orcid\.org/[0-9]{4}-[0-9]{3}[0-9X]": "https://orcid.org/0000-0000",
        r"^(https|http|ftp)://.+": "ftp://a",
        r"^[^:]+:[^:]+$": "a:a",
        r"^\d{2}-[^\d]?(x|yz)*$": "00-",
        r"(?=a)b": None,  # lookarounds are not modelled
        r'a"b': None,  # a quote would need escaping in JSON
    }
    for pattern, sample in cases.items():
        assert shortest_match(pattern) == sample, pattern
        if sample is not None:
            assert re.search(pattern, sample)


def test_finish_reserve_validation():
    with pytest.raises(ValueError, match="finish_reserve"):
        StructuredOutputsParams(json_object=True, finish_reserve=-1)
    with pytest.raises(ValueError, match="finish_reserve"):
        StructuredOutputsParams(json_object=True, finish_reserve="8")


LOOPY = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "count": {"type": "integer"},
    },
    "required": ["name", "tags", "count"],
}


def test_finish_reserve_ends_cut_outputs_in_valid_json(llm):
    """Without a reserve, outputs cut by max_tokens do not parse; with one, every output
    parses and validates, and those the budget shortened say ``length``."""
    prompts = [
        "A JSON object for a cat, with a hundred tags:",
        "Describe the history of Rome as JSON:",
        "A product record as JSON, many tags:",
    ]
    # the reserve must cover the required keys still to come: from inside "name" the shortest
    # end (`", "tags": [], "count": 0}`) is ~12 tokens, so 12 is too tight for every sample
    reserve, broken, shortened = 16, 0, 0
    for max_tokens in (24, 40):
        for temperature in (0.0, 0.9):
            outs = {}
            for r in (0, reserve):
                so = StructuredOutputsParams(json=LOOPY, finish_reserve=r)
                params = SamplingParams(
                    max_tokens=max_tokens, temperature=temperature, seed=5, structured_outputs=so
                )
                outs[r] = [o.outputs[0] for o in llm.generate(prompts, params)]
            for plain, steered in zip(outs[0], outs[reserve], strict=True):
                assert len(steered.token_ids) <= max_tokens
                jsonschema.validate(json.loads(steered.text), LOOPY)
                shortened += steered.finish_reason == "length"
                if len(plain.token_ids) <= max_tokens - reserve:  # never reached the window
                    assert steered.token_ids == plain.token_ids
                    assert steered.finish_reason == plain.finish_reason == "stop"
                try:
                    json.loads(plain.text)
                except json.JSONDecodeError:
                    broken += 1
                    assert plain.finish_reason == "length"
    assert broken > 0 and shortened > 0  # the reserve is what made the difference


def test_finish_reserve_finds_the_way_out_of_a_pattern(llm):
    """A string a pattern holds open cannot simply be closed: the steering spells the shortest
    way out (two more ':' and a character after each; an ORCID URL the unanchored pattern
    wants somewhere in the string), and the output validates."""
    prompt = "Explain in a long essay what a pipeline import is, as JSON:"
    for pattern, reserve in (("^[^:]+:[^:]+:[^:]+$", 8), ("https://orcid\\.org/[0-9]{4}", 16)):
        schema = {
            "type": "object",
            "properties": {"import": {"type": "string", "pattern": pattern}},
            "required": ["import"],
        }
        outs = {}
        for r in (0, reserve):
            so = StructuredOutputsParams(json=schema, finish_reserve=r)
            params = SamplingParams(max_tokens=40, temperature=0, structured_outputs=so)
            outs[r] = llm.generate(prompt, params)[0].outputs[0]
        assert outs[0].finish_reason == "length"  # held open, cut
        with pytest.raises(json.JSONDecodeError):
            json.loads(outs[0].text)
        jsonschema.validate(json.loads(outs[reserve].text), schema)
        window = 40 - reserve - 1  # the reserve and one open object
        assert outs[reserve].token_ids[:window] == outs[0].token_ids[:window]
