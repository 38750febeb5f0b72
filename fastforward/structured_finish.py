"""Finishing a constrained output within its token budget (``finish_reserve``).

The grammar guarantees a valid prefix; only the model decides when to end, and an output that
``max_tokens`` cuts off does not parse. In the last ``finish_reserve`` tokens (plus one per open
JSON array or object) ``steer_to_finish`` narrows each step's allowed tokens to those that end
the output soonest; the model still picks among them. ``docs/structured.md`` has the rules.
"""

from __future__ import annotations

import json
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
