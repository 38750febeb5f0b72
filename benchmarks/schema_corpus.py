"""Real JSON Schemas for structured-output tests: SchemaStore's, as vendored by the
``check-jsonschema`` package (GitHub workflows, Compose, Buildkite, GitLab CI, Snapcraft,
Mergify, ... see its ``builtin_schemas/vendor/README.md`` for sources and licenses).

Whole config-file schemas are too big for a prompt-sized test, so the corpus is every object
definition of those files that lists ``properties`` (nested objects, arrays, enums, bounds,
required and optional fields), each kept with its file's ``definitions`` so its ``$ref``s
resolve, plus the small whole-file schemas. Outputs are validated with ``jsonschema`` against
exactly these schemas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

WHOLE_FILE_MAX_BYTES = 20_000  # whole schemas up to this size are used as they are


@dataclass(frozen=True, slots=True)
class CorpusSchema:
    name: str  # "<file>#<definition>" or "<file>"
    schema: dict[str, Any]


def load_corpus() -> list[CorpusSchema]:
    """The schemas in a fixed order (sorted by file, then definition)."""
    vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    out: list[CorpusSchema] = []
    for entry in sorted(vendor.iterdir(), key=lambda p: p.name):
        if not entry.name.endswith(".json"):
            continue
        text = entry.read_text(encoding="utf-8")
        doc = json.loads(text)
        stem = entry.name.removesuffix(".json")
        if len(text) <= WHOLE_FILE_MAX_BYTES:
            out.append(CorpusSchema(stem, doc))
        for key in ("definitions", "$defs"):
            defs = doc.get(key) or {}
            for name in sorted(defs):
                d = defs[name]
                if isinstance(d, dict) and d.get("type") == "object" and "properties" in d:
                    schema = {**d, key: defs}
                    if "$schema" in doc:
                        schema["$schema"] = doc["$schema"]
                    out.append(CorpusSchema(f"{stem}#{name}", schema))
    return out


# the keywords of a field that say what its value may be (descriptions are left out: long)
_CONSTRAINTS = (
    "type",
    "enum",
    "const",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
)
PROMPT_SCHEMA_CHARS = 600  # the fields' summary is cut to this many characters


def _field_summary(node: Any, depth: int = 0) -> Any:
    """What a property's schema allows, compactly: its constraint keywords, a ``$ref`` by the
    definition's name, array items and combinator members one level down."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {k: node[k] for k in _CONSTRAINTS if k in node}
    if "$ref" in node:
        out["$ref"] = str(node["$ref"]).rsplit("/", 1)[-1]
    if depth < 1:
        if isinstance(node.get("items"), dict):
            out["items"] = _field_summary(node["items"], depth + 1)
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                out[key] = [_field_summary(m, depth + 1) for m in node[key]]
    return out


def prompt_for(item: CorpusSchema) -> str:
    """An instruction naming the schema's title/description, its required keys and what each
    top-level field allows (type, enum, pattern, bounds). The model is told the constraints,
    as OpenAI's and vLLM's structured-output guides advise: a pattern the model has not seen
    (``^[^@]+@[^@]+$``) can otherwise keep a string open until ``max_tokens``."""
    s = item.schema
    what = s.get("title") or s.get("description") or item.name.split("#")[-1]
    what = " ".join(str(what).split())[:160]
    fields = {k: _field_summary(v) for k, v in (s.get("properties") or {}).items()}
    summary = json.dumps(fields)
    if len(summary) > PROMPT_SCHEMA_CHARS:
        summary = summary[:PROMPT_SCHEMA_CHARS] + " ..."
    required = ", ".join(s.get("required", [])) or "none"
    return f"Write a JSON object for: {what}.\nRequired keys: {required}.\nFields: {summary}\nJSON:"
