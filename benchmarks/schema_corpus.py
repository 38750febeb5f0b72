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


def prompt_for(item: CorpusSchema) -> str:
    """A short instruction naming the schema's title/description and its required keys."""
    s = item.schema
    what = s.get("title") or s.get("description") or item.name.split("#")[-1]
    what = " ".join(str(what).split())[:160]
    keys = ", ".join(list(s.get("properties", {}))[:8])
    return f"Write a JSON object for: {what}. Possible keys: {keys}.\nJSON:"
