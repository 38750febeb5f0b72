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
from dataclasses import dataclass, field
from typing import Any

import torch

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
        if error and not error.startswith("WARNING"):
            what = "JSON schema" if kind in ("json", "json_object") else kind
            raise ValueError(f"invalid structured output {what}: {error.strip()}")
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


_CLOSERS = frozenset('"]}')
_OPENERS = frozenset("{[,")
_NUMBER_CHARS = "-+.eE0123456789"
_NUMBER_FREE = 16  # characters of a number literal before steering cuts it (float64 digits)
# A way out of a string that a pattern holds open is searched among runs of at most this many
# one-character tokens, drawn from the schema's patterns' own characters and these
_EXIT_DEPTH = 4
_EXIT_CHARS = "a0A@:-./_"


@dataclass(slots=True)
class FinishClasses:
    """What ``steer_to_finish`` needs of the vocabulary: every id's text, and ``[V]`` bool
    tensors of the tokens made only of ``"``, ``]`` and ``}`` (``closes``), those of them that
    close an array or object (``closes_bracket``) or begin with a quote (``quote_first``: in
    a string they end it), and the tokens that hold ``{``, ``[`` or ``,`` (``opens``)."""

    texts: Sequence[str]
    closes: torch.Tensor
    closes_bracket: torch.Tensor
    quote_first: torch.Tensor
    opens: torch.Tensor
    eos: int | None
    chars: dict[str, int] = field(default_factory=dict)  # one-character printable tokens

    @classmethod
    def from_texts(cls, texts: Sequence[str], vocab: int, eos: int | None) -> FinishClasses:
        closes, bracket, quote, opens = (torch.zeros(vocab, dtype=torch.bool) for _ in range(4))
        chars: dict[str, int] = {}
        for i, text in enumerate(texts[:vocab]):
            if len(text) == 1 and " " <= text <= "~":
                chars.setdefault(text, i)
            kinds = set(text)
            if kinds and kinds <= _CLOSERS:
                closes[i] = True
                bracket[i] = bool(kinds - {'"'})
                quote[i] = text[0] == '"'
            opens[i] = not kinds.isdisjoint(_OPENERS)
        eos = eos if eos is not None and 0 <= eos < vocab else None
        return cls(list(texts[:vocab]), closes, bracket, quote, opens, eos, chars)


def pattern_chars(schema: Any) -> str:
    """The punctuation of every ``pattern`` in a JSON Schema (where a pattern wants an ``@``
    or two ``:``, those are the characters that let a string end)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    found.update(c for c in value if "!" <= c <= "~" and not c.isalnum())
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            return ""
    walk(schema)
    return "".join(sorted(found - set('"\\')))


def string_exit(
    matcher: Any, classes: FinishClasses, alphabet: str, depth: int = _EXIT_DEPTH
) -> int | None:
    """The first token of the shortest run of at most ``depth`` one-character tokens from
    ``alphabet`` after which the grammar lets a quote end the current string (a ``pattern``
    may forbid ending it yet: ``^[^:]+:[^:]+:[^:]+$`` needs two more ``:``), or None. Checked
    with llguidance's ``validate_tokens``, which computes no masks."""
    quote = classes.chars.get('"')
    ids = list(dict.fromkeys(classes.chars[c] for c in alphabet if c in classes.chars))
    if quote is None:
        return None
    frontier: list[list[int]] = [[]]
    for _ in range(depth):
        grown = []
        for path in frontier:
            for c in ids:
                run = [*path, c]
                if matcher.validate_tokens(run) < len(run):
                    continue
                if matcher.validate_tokens([*run, quote]) == len(run) + 1:
                    return run[0]
                grown.append(run)
        frontier = grown
    return None


@dataclass(slots=True)
class JsonScan:
    """Where JSON text stands at its end, fed piece by piece: inside a string (right after a
    backslash in it), how many arrays and objects are open, how many characters of a number
    (or literal) end it, and how many tokens were fed."""

    in_string: bool = False
    escaped: bool = False
    depth: int = 0
    number: int = 0
    tokens: int = 0

    def feed(self, text: str) -> None:
        for c in text:
            if self.escaped:
                self.escaped = False
            elif self.in_string:
                if c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c in _NUMBER_CHARS:
                self.number += 1
                continue
            elif c == '"':
                self.in_string = True
            elif c in "[{":
                self.depth += 1
            elif c in "]}":
                self.depth -= 1
            self.number = 0


def scan_json(text: str) -> JsonScan:
    state = JsonScan()
    state.feed(text)
    return state


def json_state(request: Any, classes: FinishClasses) -> JsonScan | None:
    """The JSON state at the end of ``request``'s output (None unless its constraint is JSON),
    scanned incrementally: ``request.finish_scan`` keeps it between steps."""
    if request.sampling_params.structured_outputs.kind not in ("json", "json_object"):
        return None
    scan = request.finish_scan
    if scan is None:
        scan = request.finish_scan = JsonScan()
    ids = request.output_token_ids
    texts = classes.texts
    for t in ids[scan.tokens :]:
        scan.feed(texts[t] if 0 <= t < len(texts) else "")
    scan.tokens = len(ids)
    return scan


def in_finish_window(request: Any, classes: FinishClasses) -> bool:
    """Whether ``request`` samples within the last ``finish_reserve`` tokens of its budget
    (``max_tokens``, already capped by the context), plus, for JSON, a token for each array
    and object open (deep nesting takes that many to close)."""
    so = request.sampling_params.structured_outputs
    if so is None or not so.finish_reserve:
        return False
    room = request.max_tokens - request.num_output_tokens
    if room <= so.finish_reserve:
        return True
    state = json_state(request, classes)
    return state is not None and room <= so.finish_reserve + state.depth


def _finishing_tiers(
    request: Any, classes: FinishClasses, allowed: torch.Tensor
) -> list[torch.Tensor]:
    """Token classes in the order ``steer_to_finish`` prefers them for ``request``, whose
    grammar ``allowed`` [V] tokens."""
    state = json_state(request, classes)
    if state is None or state.escaped:
        return []  # other grammars: only the end itself is known
    if state.in_string:  # a closing quote, with what it may close after it; else the way to one
        quote = classes.quote_first.to(allowed.device)
        if bool((allowed & quote).any()) or request.grammar is None:
            return [quote]
        so = request.sampling_params.structured_outputs
        alphabet = _EXIT_CHARS + (pattern_chars(so.json) if so.json is not None else "")
        exit_ = string_exit(request.grammar, classes, alphabet)
        return [] if exit_ is None else [torch.arange(len(allowed), device=allowed.device) == exit_]
    # close an array or object; else a quote (a key or value the grammar requires); else
    # anything that opens nothing new
    tiers = [classes.closes_bracket, classes.closes, ~classes.opens]
    room = request.max_tokens - request.num_output_tokens
    if 0 < state.number < _NUMBER_FREE and room > state.depth + 1:
        # A shortened number is another number: the model may end it while every open
        # bracket can still close after it (a token each at most), but not start another item
        return tiers[2:]
    return tiers


def steer_to_finish(allowed: torch.Tensor, requests: list, classes: FinishClasses) -> torch.Tensor:
    """Of the tokens ``allowed`` [R, V] by each row's grammar, the ones that end the output
    soonest (rows are requests in their ``finish_reserve`` window): EOS where the grammar is
    complete; for JSON, the first non-empty class of ``_finishing_tiers`` (inside a string a
    closing quote, or the first step of ``string_exit``; outside, a closing bracket, then a
    quote, then what opens nothing); else
    all allowed. The model picks among them, so required keys and values still come from it.
    Requests whose choice this narrows are marked ``finish_steered`` (they finish with
    ``length``: shortened by the budget, not ended by the model)."""
    out = allowed.clone()
    for row, req in enumerate(requests):
        ok = allowed[row]
        eos = classes.eos
        if (
            eos is not None
            and bool(ok[eos])
            and req.num_output_tokens >= req.sampling_params.min_tokens
        ):
            pick = torch.zeros_like(ok)
            pick[eos] = True
        else:
            pick = ok
            for tier in _finishing_tiers(req, classes, ok):
                narrowed = ok & tier.to(ok.device)
                if bool(narrowed.any()):
                    pick = narrowed
                    break
        if not torch.equal(pick, ok):
            out[row] = pick
            req.finish_steered = True
    return out


def apply_grammar_masks(logits: torch.Tensor, requests: list, compiler: GrammarCompiler) -> None:
    """In place on ``logits`` [B, V]: ``-inf`` for every token the row's grammar forbids (and,
    in a request's ``finish_reserve`` window, for those ``steer_to_finish`` drops). Rows whose
    request has no grammar are left alone."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return
    vocab = logits.shape[1]
    bitmask = torch.zeros(len(rows), (vocab + 31) // 32, dtype=torch.int32)
    compiler.fill_bitmask([requests[i].grammar for i in rows], bitmask)
    allowed = bitmask_to_bool(bitmask, vocab).to(logits.device)  # [R, V]
    if any(requests[i].sampling_params.structured_outputs.finish_reserve for i in rows):
        classes = compiler.finish_classes(vocab)
        finishing = [j for j, i in enumerate(rows) if in_finish_window(requests[i], classes)]
        if finishing:
            sub = torch.tensor(finishing, device=allowed.device)
            reqs = [requests[rows[j]] for j in finishing]
            allowed[sub] = steer_to_finish(allowed[sub], reqs, classes)
    row_idx = torch.tensor(rows, device=logits.device)
    logits[row_idx] = logits[row_idx].masked_fill(~allowed, float("-inf"))
