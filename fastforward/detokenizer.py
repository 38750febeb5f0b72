"""Incremental detokenization with stop strings, for streaming.

Decoding uses the "prefix offset / read offset" scheme of TGI and vLLM: the new text of a token
is ``decode(ids[prefix:]) minus decode(ids[prefix:read])``, over a short window of recent tokens
(so cost per token does not grow with the length of the output, and tokenizers whose decoding
depends on the previous token, like SentencePiece's leading spaces, come out right). Text is
emitted only when the window's decoding does not end in U+FFFD, so a character whose UTF-8 bytes
are spread over several byte tokens comes out whole, never as replacement characters.

Stop strings are searched in the newly decoded text (plus the few characters before it that a
stop string could start in). The text is cut at the first stop string found; ``take_delta``
holds back any suffix that could still become the start of a stop string until it is decided.
"""

from __future__ import annotations

from typing import Protocol

from fastforward.sampling_params import SamplingParams

# Prompt tokens kept as decoding context for the first generated tokens (as vLLM).
_PROMPT_CONTEXT = 5
# Token ids before the decode window are dropped once this many have piled up.
_TRIM_AT = 1024
_REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    """What the detokenizer needs of a tokenizer (a HF tokenizer or our wrapper)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, token by token.

    ``update(ids)`` decodes new tokens and returns the stop string they completed, if any (after
    which further updates are ignored). ``output_text`` is the text so far (cut before the stop
    string, or after it with ``include_stop_str_in_output``). ``take_delta()`` returns the text
    that is safe to stream since the previous call; ``flush()`` (or ``take_delta(final=True)``)
    ends the sequence, decoding any incomplete trailing bytes and releasing held-back text.
    """

    def __init__(
        self, tokenizer: TokenDecoder, prompt_token_ids: list[int], params: SamplingParams
    ):
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._max_stop_len = max((len(s) for s in self._stops), default=0)

        # Decode window over _ids: text of _ids[_prefix:_read] has been emitted already.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)
        self._prefix_text: str | None = None  # cached decode of _ids[_prefix:_read]

        # Output text as chunks (appending stays O(1)); _emitted counts chars given to take_delta.
        self._parts: list[str] = []
        self._len = 0
        self._emitted = 0
        self.num_output_tokens = 0
        self.stop_str: str | None = None
        self.finished = False

    # ------------------------------------------------------------------ public API

    @property
    def output_text(self) -> str:
        """All text decoded so far (cut at a stop string if one was hit)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def update(self, new_token_ids: list[int]) -> str | None:
        """Decode ``new_token_ids``; return the stop string they completed, else None."""
        if self.finished:
            return None
        for token_id in new_token_ids:
            self._ids.append(token_id)
            self.num_output_tokens += 1
            new_text = self._decode_step(final=False)
            if new_text and self._append(new_text):
                return self.stop_str
        self._trim()
        return None

    def flush(self) -> None:
        """End of the sequence: decode incomplete trailing bytes (they become U+FFFD, as a full
        decode would) and release the held-back text to ``take_delta``."""
        if self.finished:
            return
        new_text = self._decode_step(final=True)
        if new_text:
            self._append(new_text)
        self.finished = True

    def take_delta(self, final: bool = False) -> str:
        """Text added since the previous call that can no longer be cut by a stop string.
        ``final=True`` first calls ``flush()``."""
        if final:
            self.flush()
        safe_end = self._len if self.finished else self._len - self._held_back()
        if safe_end <= self._emitted:
            return ""
        pending = self._tail(self._len - self._emitted)
        self._emitted = safe_end
        return pending[: len(pending) - (self._len - safe_end)]

    # ------------------------------------------------------------------ decoding

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def _decode_step(self, final: bool) -> str:
        """New text of the tokens after the read offset, or "" while it would end in an
        incomplete character (unless ``final``). Advances the offsets when text is produced."""
        if self._read >= len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix, self._read)
        window_text = self._decode(self._prefix)
        if len(window_text) <= len(self._prefix_text):
            return ""
        if window_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        new_text = window_text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = None
        return new_text

    def _trim(self) -> None:
        """Drop token ids before the decode window so memory does not grow with the output."""
        if self._prefix >= _TRIM_AT:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    # ------------------------------------------------------------------ text and stop strings

    def _append(self, text: str) -> bool:
        """Add decoded text; True (and cut the text, mark finished) if a stop string appeared."""
        self._parts.append(text)
        self._len += len(text)
        if not self._stops or self.num_output_tokens <= self._min_tokens:
            return False
        hit = self._find_stop(len(text))
        if hit is None:
            return False
        start, stop = hit
        self._truncate(start + len(stop) if self._include_stop else start)
        self.stop_str = stop
        self.finished = True
        return True

    def _find_stop(self, new_chars: int) -> tuple[int, str] | None:
        """(absolute start, stop string) of the stop string that ends first among those ending
        in the newest ``new_chars`` characters (earlier text was checked already)."""
        window_len = min(self._len, new_chars + self._max_stop_len - 1)
        window = self._tail(window_len)
        best: tuple[int, int, str] | None = None  # (end, start, stop) within window
        for stop in self._stops:
            idx = window.find(stop, max(0, window_len - new_chars - len(stop) + 1))
            if idx < 0:
                continue
            candidate = (idx + len(stop), idx, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        return self._len - window_len + best[1], best[2]

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string
        (text that a later token could turn into a stop string, which would then be cut)."""
        if not self._stops or self._include_stop:
            return 0
        tail = self._tail(min(self._len, self._max_stop_len - 1))
        for n in range(len(tail), 0, -1):
            suffix = tail[-n:]
            if any(len(s) > n and s.startswith(suffix) for s in self._stops):
                return n
        return 0

    def _tail(self, n: int) -> str:
        """The last ``n`` characters of the text, touching only the chunks that hold them."""
        if n <= 0:
            return ""
        pieces: list[str] = []
        need = n
        for part in reversed(self._parts):
            if len(part) >= need:
                pieces.append(part[len(part) - need :])
                break
            pieces.append(part)
            need -= len(part)
        return "".join(reversed(pieces))

    def _truncate(self, end: int) -> None:
        """Cut the text to its first ``end`` characters."""
        text = self.output_text[:end]
        self._parts = [text]
        self._len = len(text)
        self._emitted = min(self._emitted, self._len)
