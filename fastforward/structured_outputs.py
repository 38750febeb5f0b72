"""Structured outputs: JSON, JSON Schema, regex, choice and Lark grammars, enforced per token.

The grammar engine is llguidance (Rust; what vLLM uses by default): it compiles a constraint
into a matcher that, at every step, gives the set of tokens that keep the output a prefix of a
valid sentence. The sampler sets every other logit to ``-inf`` (``apply_grammar_masks``) in the
same batched pass as the free requests; the engine feeds each sampled token back to the matcher
and ends the request when the grammar is complete.

Why llguidance: it installs as one wheel with no dependencies here (xgrammar pulls triton and
transformers), and builds masks in ~0.1-2 ms per token on this CPU (``benchmarks/
bench_structured.py`` measures the per-token overhead).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastforward.structured_finish import FinishClasses, in_finish_window, steer_to_finish

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# JSON as ``json.dumps`` writes it (the spacing models have seen most), no free whitespace: a
# model can't pad with newlines forever. Not lenient: a keyword llguidance can't enforce makes
# the schema an error instead of being ignored (which would let invalid outputs through).
JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}


_COMBINATORS = ("allOf", "anyOf", "oneOf")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")


def _without_formats(schema: Any, formats: set[str]) -> Any:
    if isinstance(schema, list):
        return [_without_formats(s, formats) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {
        k: _without_formats(v, formats)
        for k, v in schema.items()
        if not (k == "format" and isinstance(v, str) and v in formats)
    }


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` where objects that list ``properties`` and say nothing about extra
    ones get ``additionalProperties: false`` (as xgrammar's strict mode and OpenAI's strict
    schemas): every output still validates against the original schema, and the model can't
    invent keys without end. Schemas that combine with others (members of ``allOf``/``anyOf``/
    ``oneOf``, the definitions those members ``$ref``, and schemas holding a combinator) stay
    open: closing them would forbid the keys their partners add."""
    shared = set()

    def find_shared(node: Any) -> None:
        if isinstance(node, list):
            for n in node:
                find_shared(n)
        elif isinstance(node, dict):
            for key in _COMBINATORS:
                for member in node.get(key, []) if isinstance(node.get(key), list) else []:
                    if isinstance(member, dict) and isinstance(member.get("$ref"), str):
                        shared.add(member["$ref"].rsplit("/", 1)[-1])
            for v in node.values():
                find_shared(v)

    def close(node: Any, open_: bool = False) -> Any:
        if isinstance(node, list):
            return [close(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for k, v in node.items():
            if k in _COMBINATORS and isinstance(v, list):
                out[k] = [close(m, open_=True) for m in v]
            elif k in ("definitions", "$defs") and isinstance(v, dict):
                out[k] = {name: close(d, open_=name in shared) for name, d in v.items()}
            else:
                out[k] = close(v)
        if (
            not open_
            and "properties" in out
            and not any(k in out for k in _COMBINATORS)
            and not any(
                k in out
                for k in (
                    "additionalProperties",
                    "patternProperties",
                    "unevaluatedProperties",
                    "$ref",
                )
            )
        ):
            out["additionalProperties"] = False
        return out

    find_shared(schema)
    return close(schema)


@dataclass(slots=True)
class StructuredOutputsParams:
    """What the output must match; exactly one field is set. Names follow vLLM's
    ``StructuredOutputsParams``: ``json`` is a JSON Schema (dict or string), ``regex`` a regular
    expression (Rust ``regex`` syntax), ``choice`` a list of strings, ``grammar`` a Lark
    grammar (llguidance's dialect), ``json_object`` any JSON object."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # Steer the output to an end in the last ``finish_reserve`` tokens of its budget (0: off;
    # ``steer_to_finish``): an output cut by ``max_tokens`` or the context does not parse.
    finish_reserve: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        """Raise ``ValueError`` unless exactly one constraint of the right type is given."""
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object (got {', '.join(given) or 'none'})"
            )
        if (
            isinstance(self.finish_reserve, bool)
            or not isinstance(self.finish_reserve, int)
            or self.finish_reserve < 0
        ):
            raise ValueError(
                "structured_outputs.finish_reserve must be an integer >= 0 (tokens), "
                f"got {self.finish_reserve!r}"
            )
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError("structured_outputs.json must be a JSON Schema object or string")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured_outputs.grammar must be a string")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise ValueError(
                "structured_outputs.choice must be a non-empty list of non-empty strings"
            )

    def cache_key(self) -> str:
        value = getattr(self, self.kind)
        return self.kind + ":" + json.dumps(value, sort_keys=True)


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` into validated llguidance grammars (cached) and
    makes one matcher per sequence. The tokenizer's vocabulary is read once, on first use."""

    def __init__(
        self,
        backend: Any,
        vocab_size: int,
        eos_token_id: int | None,
        token_texts: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        self._backend = backend  # a ``tokenizers.Tokenizer``; serialized only on first use
        self._vocab_size = vocab_size
        self._eos = eos_token_id
        self._token_texts = token_texts  # every id's text, for ``finish_classes``
        self._finish_classes: FinishClasses | None = None
        self._lltok = None
        self._grammars: dict[str, str] = {}
        self._executor = None

    @property
    def tokenizer(self):
        if self._lltok is None:
            import llguidance

            self._lltok = llguidance.LLTokenizer(
                self._backend.to_str(), n_vocab=self._vocab_size, eos_token=self._eos
            )
        return self._lltok

    def compile(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar for ``params``; ``ValueError`` naming the problem when the
        schema, regex or grammar is malformed or cannot be satisfied."""
        key = params.cache_key()
        grammar = self._grammars.get(key)
        if grammar is not None:
            return grammar
        kind = params.kind
        try:
            grammar, error = self._compile(params)
        except (ValueError, TypeError, RecursionError) as e:
            raise ValueError(f"invalid structured output {kind}: {e}") from None
        what = "JSON schema" if kind in ("json", "json_object") else kind
        if error and not error.startswith("WARNING"):
            raise ValueError(f"invalid structured output {what}: {error.strip()}")
        if not self._can_begin(grammar):
            raise ValueError(
                f"invalid structured output {what}: no token of this model's vocabulary can "
                "begin an output that matches it"
            )
        if len(self._grammars) > 256:
            self._grammars.clear()
        self._grammars[key] = grammar
        return grammar

    def _compile(self, params: StructuredOutputsParams) -> tuple[str, str]:
        """(grammar, llguidance's validation message: empty when valid)."""
        from llguidance import LLMatcher

        kind = params.kind
        if kind in ("json", "json_object"):
            return self._json_grammar({"type": "object"} if kind == "json_object" else params.json)
        if kind == "regex":
            grammar = LLMatcher.grammar_from_regex(params.regex)
        elif kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in params.choice)
            grammar = LLMatcher.grammar_from_lark(f"start: {alternatives}")
        else:
            grammar = LLMatcher.grammar_from_lark(params.grammar)
        return grammar, LLMatcher.validate_grammar(grammar, self.tokenizer)

    def _can_begin(self, grammar: str) -> bool:
        """Whether some vocabulary token can begin an output of ``grammar`` (or the empty
        output is already complete). Where the grammar forces text that spells a special token
        (a regex ``<s>``), llguidance's mask offers that token alone and then refuses to
        consume it, which mid-request is an engine error: each offered token is tried until
        one is taken."""
        from llguidance import LLMatcher

        m = LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error() or m.is_accepting():
            return True  # matcher() reports an error; an accepting start can finish at once
        offered = self.allowed_tokens([m], self._vocab_size)[0].nonzero().flatten().tolist()
        return any(m.validate_tokens([t]) == 1 for t in offered)

    def _json_grammar(self, schema: dict[str, Any] | str) -> tuple[str, str]:
        """A JSON Schema's grammar, with objects closed (``closed_objects``).

        ``format`` is an annotation unless a validator opts in (JSON Schema 2019-09+): formats
        llguidance doesn't know are dropped, not refused. Any other keyword it can't enforce
        (uniqueItems, not, if/then, ...) refuses the schema: an output that doesn't validate
        is never produced silently."""
        from llguidance import LLMatcher

        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON ({e})") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON Schema must be an object or a boolean")
        schema = closed_objects(schema)
        dropped: set[str] = set()
        while True:
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            error = LLMatcher.validate_grammar(grammar, self.tokenizer)
            unknown = _UNKNOWN_FORMAT.search(error) if error else None
            if unknown is None or unknown.group(1) in dropped:
                return grammar, error
            dropped.add(unknown.group(1))
            schema = _without_formats(schema, dropped)

    def matcher(self, grammar: str):
        from llguidance import LLMatcher

        m = LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"invalid structured output: {m.get_error()}")
        return m

    def finish_classes(self, vocab: int) -> FinishClasses:
        """The vocabulary sorted for ``steer_to_finish`` (computed once)."""
        if self._finish_classes is None:
            texts = self._token_texts() if self._token_texts is not None else []
            self._finish_classes = FinishClasses.from_texts(texts, vocab, self._eos)
        return self._finish_classes

    def allowed_tokens(self, matchers: list, vocab: int) -> torch.Tensor:
        """[R, vocab] bool: the tokens each matcher allows next."""
        bitmask = torch.zeros(len(matchers), (vocab + 31) // 32, dtype=torch.int32)
        self.fill_bitmask(matchers, bitmask)
        return bitmask_to_bool(bitmask, vocab)

    def fill_bitmask(self, matchers: list, bitmask: torch.Tensor) -> None:
        """Allowed-token bits of each matcher into row ``i`` of ``bitmask`` [R, ceil(V/32)]
        int32, computed in parallel threads."""
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        row_bytes = bitmask.shape[1] * 4
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), row_bytes, len(pairs))


def bitmask_to_bool(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 bit sets -> [R, vocab] bool (bit ``j % 32`` of word ``j // 32``)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_grammar_masks(logits: torch.Tensor, requests: list, compiler: GrammarCompiler) -> None:
    """In place on ``logits`` [B, V]: ``-inf`` for every token the row's grammar forbids (and,
    in a request's ``finish_reserve`` window, for those ``steer_to_finish`` drops). Rows whose
    request has no grammar are left alone."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return
    vocab = logits.shape[1]
    allowed = compiler.allowed_tokens([requests[i].grammar for i in rows], vocab)
    allowed = allowed.to(logits.device)  # [R, V]
    if any(requests[i].sampling_params.structured_outputs.finish_reserve for i in rows):
        classes = compiler.finish_classes(vocab)
        finishing = [j for j, i in enumerate(rows) if in_finish_window(requests[i], classes)]
        if finishing:
            sub = torch.tensor(finishing, device=allowed.device)
            reqs = [requests[rows[j]] for j in finishing]
            allowed[sub] = steer_to_finish(allowed[sub], reqs, classes)
    row_idx = torch.tensor(rows, device=logits.device)
    logits[row_idx] = logits[row_idx].masked_fill(~allowed, float("-inf"))
