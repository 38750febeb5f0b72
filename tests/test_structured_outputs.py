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


def test_constrained_and_free_requests_share_a_batch(llm):
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
