"""Finishing a constrained output within its token budget (``finish_reserve``).

The grammar guarantees a valid prefix; only the model decides when to end, and an output that
``max_tokens`` cuts off does not parse. In the last ``finish_reserve`` tokens (plus one per open
JSON array or object) ``steer_to_finish`` narrows each step's allowed tokens to those that end
the output soonest; the model still picks among them. ``docs/structured.md`` has the rules.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

_CLOSERS = frozenset('"]}')
_OPENERS = frozenset("{[,")
_NUMBER_CHARS = "-+.eE0123456789"
_NUMBER_FREE = 16  # characters of a number literal before steering cuts it (float64 digits)
# A way out of a string that a pattern holds open is searched among runs of at most this many
# one-character tokens, drawn from the schema's patterns' own characters and these
_EXIT_DEPTH = 2
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
    _by_text: dict[str, list[int]] | None = field(default=None, repr=False)

    def tokens_spelling(self, text: str) -> list[list[int]]:
        """Ids of the tokens whose text is a non-empty beginning of ``text``, by its length
        (shortest first; lengths no token spells are left out)."""
        if self._by_text is None:
            self._by_text = {}
            for i, t in enumerate(self.texts):
                self._by_text.setdefault(t, []).append(i)
        spelt = (self._by_text.get(text[:k]) for k in range(1, len(text) + 1))
        return [ids for ids in spelt if ids]

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


def schema_patterns(schema: Any) -> list[str]:
    """Every ``pattern`` of a JSON Schema (a dict, or its JSON text)."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            return []
    walk(schema)
    return list(dict.fromkeys(found))


_SAMPLE_CHARS = "a0A_-.:/@ " + "".join(chr(c) for c in range(33, 127))


@functools.lru_cache(maxsize=1024)
def shortest_match(pattern: str) -> str | None:
    """A shortest string ``pattern`` matches (a character class gives its first member of
    ``_SAMPLE_CHARS``, a branch its shortest alternative, a repeat its minimum), or None for
    what this does not model (lookarounds, back-references) and for samples that would need
    a quote or backslash (escapes in JSON)."""
    from re import _constants as c
    from re import _parser as sre

    def member(items: list, ch: str) -> bool:
        negate = bool(items) and items[0][0] == c.NEGATE
        code, hit = ord(ch), False
        for op, arg in items[1:] if negate else items:
            if op == c.LITERAL:
                hit = hit or code == arg
            elif op == c.RANGE:
                hit = hit or arg[0] <= code <= arg[1]
            elif op == c.CATEGORY:
                hit = hit or bool(re.fullmatch(_CATEGORIES.get(str(arg), "(?!)"), ch))
        return hit != negate

    def sample(items: Any) -> str | None:
        out = []
        for op, arg in items:
            if op == c.LITERAL:
                part = chr(arg)
            elif op == c.NOT_LITERAL:
                part = next(ch for ch in _SAMPLE_CHARS if ord(ch) != arg)
            elif op == c.ANY:
                part = "a"
            elif op == c.IN:
                part = next((ch for ch in _SAMPLE_CHARS if member(arg, ch)), None)
            elif op == c.BRANCH:
                alts = [a for a in (sample(b) for b in arg[1]) if a is not None]
                part = min(alts, key=len) if alts else None
            elif op == c.SUBPATTERN:
                part = sample(arg[-1])
            elif op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
                one = sample(arg[2])
                part = None if one is None else one * arg[0]
            elif op == c.ATOMIC_GROUP:
                part = sample(arg)
            elif op == c.AT:
                part = ""
            else:
                part = None
            if part is None:
                return None
            out.append(part)
        return "".join(out)

    try:
        text = sample(sre.parse(pattern))
    except (re.error, RecursionError, StopIteration, TypeError, ValueError):
        return None
    if text is None or '"' in text or "\\" in text:
        return None
    return text


_CATEGORIES = {
    "CATEGORY_DIGIT": r"\d",
    "CATEGORY_NOT_DIGIT": r"\D",
    "CATEGORY_SPACE": r"\s",
    "CATEGORY_NOT_SPACE": r"\S",
    "CATEGORY_WORD": r"\w",
    "CATEGORY_NOT_WORD": r"\W",
}


def string_exit(matcher: Any, classes: FinishClasses, patterns: Sequence[str]) -> str | None:
    """The shortest text after which the grammar lets a quote end the current string, which a
    ``pattern`` holds open (``^[^:]+:[^:]+$`` before any ``:``; an unanchored
    ``https://orcid\\.org/...`` anywhere in it), or None. Candidates: every one or two
    characters of ``_EXIT_CHARS`` and the patterns' punctuation, and every tail of each
    pattern's ``shortest_match``; spelt in one-character tokens and checked with llguidance's
    ``validate_tokens``, which computes no masks."""
    quote = classes.chars.get('"')
    if quote is None:
        return None
    punctuation = {ch for p in patterns for ch in p if "!" <= ch <= "~" and not ch.isalnum()}
    alphabet = [
        ch
        for ch in dict.fromkeys(_EXIT_CHARS + "".join(sorted(punctuation)))
        if ch in classes.chars and ch not in '"\\'
    ]

    def accepted(text: str) -> int:
        """How many tokens of ``text`` spelt one character a token, then a quote, the
        grammar takes: ``len(text) + 1`` where the quote ends the string there."""
        return matcher.validate_tokens([*(classes.chars[ch] for ch in text), quote])

    frontier = [""]
    for _ in range(_EXIT_DEPTH):
        grown = []
        for path in frontier:
            for ch in alphabet:
                text = path + ch
                taken = accepted(text)
                if taken == len(text) + 1:
                    return text
                if taken == len(text):  # a valid step, no way out yet
                    grown.append(text)
        frontier = grown
    tails = {t[i:] for t in map(shortest_match, patterns) if t for i in range(len(t))}
    for tail in sorted(tails, key=len):
        if all(ch in classes.chars for ch in tail) and accepted(tail) == len(tail) + 1:
            return tail
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
        way = string_exit(request.grammar, classes, schema_patterns(so.json))
        if way is None:
            return []
        # the longest token that spells a beginning of the way out and the grammar allows
        tiers = []
        for ids in reversed(classes.tokens_spelling(way)):
            tier = torch.zeros_like(allowed)
            tier[ids] = True
            tiers.append(tier)
        return tiers
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
