"""Mistral: the Llama architecture with sliding-window attention on every layer (the window
comes from the config, so the Llama classes serve unchanged)."""

from fastforward.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
