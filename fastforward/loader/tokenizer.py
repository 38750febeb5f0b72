"""Tokenizer: text <-> token ids, and chat prompts, on top of the Rust `tokenizers` library.

A GGUF file has no `tokenizer.json`: it stores the vocabulary, merges, token types and special ids
as metadata under llama.cpp's key names. `Tokenizer.from_gguf` rebuilds a `tokenizers.Tokenizer`
from those, following llama.cpp's meaning of each key (that is what the GGUF was written for):

* `tokenizer.ggml.model == "gpt2"`: byte-level BPE. The pre-tokenizer (how text is cut into words
  before BPE) is not stored, only its name in `tokenizer.ggml.pre`; `_BYTE_LEVEL_SPLITS` maps names
  to the regexes llama.cpp uses for them.
* `tokenizer.ggml.model == "llama"`: SentencePiece-style BPE with byte fallback (Gemma, Llama 2).
  Such files usually carry no merges, so they are rebuilt from the vocabulary.

HF model directories go through `Tokenizer.from_hf_dir`, which reads `tokenizer.json` as is.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from fastforward.loader.chat_template import render_chat_template
from fastforward.loader.gguf_file import read_gguf_metadata

__all__ = ["Tokenizer", "read_gguf_metadata"]

logger = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Tokens that end a generation when a model emits them, besides its EOS: the end-of-turn markers
# of chat formats and end-of-document tokens. This is llama.cpp's end-of-generation list; for the
# models we ship it gives what their HF generation_config.json says (Qwen2.5: <|im_end|> and
# <|endoftext|>; Gemma 3: <eos> and <end_of_turn>), and for SmolLM2 adds <|endoftext|> to
# <|im_end|>.
_END_OF_GENERATION = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<｜end▁of▁sentence｜>",  # DeepSeek
)

# --- byte-level BPE pre-tokenizers -------------------------------------------------------------

# GPT-2's split, which `pre_tokenizers.ByteLevel(use_regex=True)` applies itself.
_GPT2 = "gpt2"
# Qwen2: like Llama 3's but single digits; contractions case-insensitive.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# StarCoder family (SmolLM, SmolLM2 among them): every digit is its own word, then GPT-2's split.
# llama.cpp runs `\p{N}` then the GPT-2 regex; the models' own tokenizer.json say
# Sequence[Digits(individual_digits), ByteLevel]. Both differ from GPT-2 alone on text like "a  1"
# (GPT-2 keeps " 1" together, so the run of spaces is cut differently).
_DIGITS_THEN_GPT2 = "digits+gpt2"

_BYTE_LEVEL_SPLITS: dict[str, str] = {
    "default": _GPT2,
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "jais": _GPT2,
    "exaone4": _GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2,
    "smollm": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "exaone": _DIGITS_THEN_GPT2,
    "minerva-7b": _DIGITS_THEN_GPT2,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "kormo": _QWEN2_SPLIT,
    "megrez": _QWEN2_SPLIT,
    "stablelm2": _QWEN2_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "pixtral": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
}
# Vocabularies whose BPE looks a whole word up in the vocabulary before merging (llama.cpp's
# `ignore_merges`): Llama 3's merges do not reproduce all of its vocabulary.
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"}


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    split = _BYTE_LEVEL_SPLITS.get(pre or "default")
    if split is None:
        logger.warning("unknown tokenizer.ggml.pre %r; using GPT-2's pre-tokenizer", pre)
        split = _GPT2
    if split == _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters, in which byte-level vocabularies are spelled."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


# --- reading GGUF metadata ---------------------------------------------------------------------


def _metadata_from(source: Any) -> dict[str, Any]:
    """Metadata from a path, an open `gguf.GGUFReader`, or a ready dict."""
    if isinstance(source, str | os.PathLike):
        return read_gguf_metadata(source, prefix="")
    if isinstance(source, Mapping):
        return dict(source)
    fields = getattr(source, "fields", None)  # gguf.GGUFReader, without importing gguf here
    if fields is not None:
        return {
            k: f.contents() for k, f in fields.items() if k.startswith(("tokenizer.", "general."))
        }
    raise TypeError(f"expected a GGUF path, a gguf.GGUFReader or a dict, got {type(source)!r}")


# --- building the backend from GGUF metadata ---------------------------------------------------


def _byte_level_from_gguf(meta: Mapping[str, Any]) -> tokenizers.Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens are normally already spelled in the byte alphabet; a few converters wrote some raw
    # (e.g. with real spaces), so re-spell those from their UTF-8 bytes.
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    model = BPE(
        vocab=vocab,
        merges=merges,
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        ignore_merges=meta.get("tokenizer.ggml.pre") in _IGNORE_MERGES,
    )
    tk = tokenizers.Tokenizer(model)
    tk.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tk.decoder = decoders.ByteLevel()
    _add_gguf_special_tokens(tk, meta, spelled_in=alphabet)
    return tk


def _sentencepiece_from_gguf(meta: Mapping[str, Any]) -> tokenizers.Tokenizer:
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    arch = meta.get("general.architecture", "")
    gemma = arch.startswith("gemma")
    if gemma:
        # Gemma stores tokens made only of spaces as real spaces ("  "), but its text is looked up
        # with spaces replaced by "▁"; respell them so they can be reached (as transformers does).
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        # SentencePiece BPE merges the adjacent pair whose result scores best. Gemma's scores do
        # not follow the merge order its tokens were learned in; their order in the file does.
        if gemma:
            scores = {t: -i for i, t in enumerate(tokens)}
        else:
            scores = dict(zip(tokens, meta["tokenizer.ggml.scores"], strict=True))
        merges = _merges_from_vocab(vocab, scores)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else "<unk>"
    tk = tokenizers.Tokenizer(
        BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    decode_steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", not gemma):
        # Llama-2 style: a "▁" is put before the first word, and dropped again when decoding.
        tk.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first", split=False
        )
        decode_steps.append(decoders.Strip(content=" ", left=1))
    else:
        tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.decoder = decoders.Sequence(decode_steps)
    _add_gguf_special_tokens(tk, meta, spelled_in=None)
    return tk


def _merges_from_vocab(
    vocab: Mapping[str, int], scores: Mapping[str, float]
) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary: every split of a token into two tokens, best-scoring
    result first (ties: longer left piece first). Same order as transformers' `generate_merges`."""
    # ~1.2M candidate splits for Gemma's 262k tokens: keep the inner loop minimal.
    known = vocab.__contains__
    ranked = []
    append = ranked.append
    for token, score in scores.items():
        for cut in range(1, len(token)):
            if known(token[:cut]) and known(token[cut:]):
                append((score, cut, token))
    # len(right) is implied by the token and the cut, so (score, cut) is the full sort key.
    ranked.sort(key=lambda m: (m[0], m[1]), reverse=True)
    return [(token[:cut], token[cut:]) for _, cut, token in ranked]


def _add_gguf_special_tokens(
    tk: tokenizers.Tokenizer, meta: Mapping[str, Any], spelled_in: set[str] | None
) -> None:
    """Control tokens (`<|im_start|>`, `<bos>`) become special tokens and user-defined ones (`\\n\\n`
    in Gemma, `<tool_call>` in Qwen) plain added tokens, so text containing them encodes each as
    one id instead of spelling it out; decoding with `skip_special_tokens` drops only the former.
    """
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or []
    vocab = tk.get_vocab(with_added_tokens=False)
    control, user = [], []
    for token, kind in zip(tokens, types, strict=False):
        if kind == _CONTROL:
            # In a byte-level vocabulary a control token outside the byte alphabet is a converter
            # mislabel that the model never saw as a unit.
            if spelled_in is None or set(token) <= spelled_in:
                control.append(AddedToken(token, normalized=False, special=True))
        elif kind == _USER_DEFINED and token in vocab:
            user.append(AddedToken(token, normalized=False, special=False))
    if control:
        tk.add_special_tokens(control)
    if user:
        tk.add_tokens(user)


def _bos_eos_processor(
    tk: tokenizers.Tokenizer,
    bos: str | None,
    eos: str | None,
) -> processors.TemplateProcessing:
    """Post-processor adding `bos` before and `eos` after a sequence (either may be None)."""
    single, pair, special = "$A:0", "$A:0 $B:1", []
    if bos is not None:
        single, pair = f"{bos}:0 {single}", f"{bos}:0 $A:0 {bos}:1 $B:1"
        special.append((bos, tk.token_to_id(bos)))
    if eos is not None:
        single, pair = f"{single} {eos}:0", f"{pair} {eos}:1"
        if eos != bos:
            special.append((eos, tk.token_to_id(eos)))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


# --- the tokenizer -----------------------------------------------------------------------------


class Tokenizer:
    """A model's tokenizer: encode/decode, special token ids, chat template.

    Wraps a `tokenizers.Tokenizer` whose post-processor adds BOS/EOS as the model wants, so
    `encode(text)` gives the ids the model expects for a raw prompt and
    `encode(text, add_special_tokens=False)` just the text's own tokens (as for a chat prompt that
    already starts with its BOS).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._tk = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.chat_template = chat_template
        ids = set(eos_token_ids)
        if eos_token_id is not None:
            ids.add(eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self._special_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )

    # -- construction --

    @classmethod
    def from_gguf(cls, source: str | os.PathLike | Any) -> Tokenizer:
        """Build from a GGUF file's metadata: a path, an open `gguf.GGUFReader` or a metadata dict."""
        meta = _metadata_from(source)
        kind = meta.get("tokenizer.ggml.model")
        if "tokenizer.ggml.tokens" not in meta:
            raise ValueError("GGUF metadata has no tokenizer (no tokenizer.ggml.tokens)")
        if kind == "gpt2":
            backend = _byte_level_from_gguf(meta)
        elif kind == "llama":
            backend = _sentencepiece_from_gguf(meta)
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2' byte-level BPE, "
                "'llama' SentencePiece BPE)"
            )
        tokens = meta["tokenizer.ggml.tokens"]

        def token_id(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
        # llama.cpp's defaults when the flags are absent: SentencePiece models add BOS.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        backend.post_processor = _bos_eos_processor(
            backend,
            tokens[bos] if add_bos and bos is not None else None,
            tokens[eos] if add_eos and eos is not None else None,
        )
        types = meta.get("tokenizer.ggml.token_type") or []
        eog = {
            i
            for i, t in enumerate(tokens)
            if t in _END_OF_GENERATION and (i >= len(types) or types[i] == _CONTROL)
        }
        eog |= {i for i in (token_id("eot_token_id"), token_id("eom_token_id")) if i is not None}
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=token_id("padding_token_id"),
            unk_token_id=token_id("unknown_token_id"),
            add_bos_token=add_bos,
            add_eos_token=add_eos,
            chat_template=meta.get("tokenizer.chat_template"),
            eos_token_ids=eog,
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Build from an HF model directory: `tokenizer.json`, `tokenizer_config.json`, and the
        EOS ids of `generation_config.json` / `config.json` where present."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ValueError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
        backend = tokenizers.Tokenizer.from_file(str(tj))
        config = _read_json(path / "tokenizer_config.json")

        def token_of(name: str) -> str | None:
            value = config.get(name)
            if isinstance(value, Mapping):  # serialized AddedToken
                value = value.get("content")
            return value if isinstance(value, str) else None

        def id_of(name: str) -> int | None:
            token = token_of(name)
            return backend.token_to_id(token) if token is not None else None

        bos_id, eos_id = id_of("bos_token"), id_of("eos_token")
        model_config = _read_json(path / "config.json")
        gen_config = _read_json(path / "generation_config.json")
        if bos_id is None:
            bos_id = _first_id(gen_config.get("bos_token_id", model_config.get("bos_token_id")))
        if eos_id is None:
            eos_id = _first_id(gen_config.get("eos_token_id", model_config.get("eos_token_id")))
        add_bos = bool(config.get("add_bos_token", False))
        add_eos = bool(config.get("add_eos_token", False))
        if "add_bos_token" in config or "add_eos_token" in config:
            # The flags win over tokenizer.json's post-processor (as in transformers), which older
            # Llama-style repos left out of sync.
            backend.post_processor = _bos_eos_processor(
                backend,
                token_of("bos_token") if add_bos else None,
                token_of("eos_token") if add_eos else None,
            )
        else:
            add_bos = _post_processor_adds(backend, bos_id)

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        eog = set()
        for source in (gen_config.get("eos_token_id"), model_config.get("eos_token_id")):
            eog |= set(_all_ids(source))
        specials = {
            t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special
        }
        eog |= {specials[t] for t in _END_OF_GENERATION if t in specials}
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            pad_token_id=id_of("pad_token"),
            unk_token_id=id_of("unk_token"),
            add_bos_token=add_bos,
            add_eos_token=add_eos,
            chat_template=template,
            eos_token_ids=eog,
        )

    # -- encoding and decoding --

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS/EOS where the model adds them.

        Special tokens written in the text (e.g. `<|im_start|>`) encode as their single ids.
        """
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """`encode` for many texts at once (parallel in Rust)."""
        return [
            e.ids for e in self._tk.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        ]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes of an incomplete UTF-8 character come out as U+FFFD."""
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | None | list[str | None]:
        """The vocabulary entry (as spelled in the vocabulary) of an id, or of each id."""
        if isinstance(ids, int):
            return self._tk.id_to_token(ids)
        return [self._tk.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    # -- properties --

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tk

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._tk.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self._tk.id_to_token(self.eos_token_id)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of all special tokens (those `decode(skip_special_tokens=True)` drops), sorted."""
        ids = set(self._special_ids)
        ids.update(
            i
            for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id)
            if i is not None
        )
        return sorted(ids)

    # -- chat --

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for a conversation, rendered with the model's chat template.

        Encode the result with `add_special_tokens=False`: templates write their own BOS.
        """
        specials = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
        }
        if self.unk_token_id is not None:
            specials["unk_token"] = self._tk.id_to_token(self.unk_token_id)
        if self.pad_token_id is not None:
            specials["pad_token"] = self._tk.id_to_token(self.pad_token_id)
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **{**specials, **kwargs},
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r}, eos_token_ids={sorted(self.eos_token_ids)}, "
            f"add_bos={self.add_bos_token}, chat_template={self.chat_template is not None})"
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _all_ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _first_id(value: Any) -> int | None:
    ids = _all_ids(value)
    return ids[0] if ids else None


def _post_processor_adds(backend: tokenizers.Tokenizer, bos_id: int | None) -> bool:
    """Whether encoding an empty text with special tokens yields the BOS."""
    if bos_id is None:
        return False
    return bos_id in backend.encode("", add_special_tokens=True).ids
