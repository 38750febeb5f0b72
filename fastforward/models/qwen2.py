"""Qwen2 / Qwen2.5: the Llama architecture with biases on q/k/v (``attention_bias`` is implied
by ``model_type == "qwen2"`` in the config reader) and optional sliding-window layers."""

from fastforward.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
