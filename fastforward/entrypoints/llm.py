"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, as in vLLM."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import fields
from typing import Any

from tqdm import tqdm

from fastforward.engine import EngineArgs, LLMEngine
from fastforward.outputs import RequestOutput
from fastforward.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]
Message = dict[str, Any]


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching.

    ``model`` is a catalog name (``smollm2-135m``, ``gemma3-270m``, ``qwen2.5-coder-0.5b``,
    ``qwen2.5-coder-1.5b``; pulled on first use), a ``.gguf`` file, or an HF directory.
    Other keyword arguments are ``EngineArgs`` fields (``dtype``, ``max_model_len``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``, ``kv_cache_memory_bytes``,
    ``num_kv_blocks``, ``seed``, ...).
    """

    def __init__(self, model: str = EngineArgs.model, **kwargs: Any) -> None:
        known = {f.name for f in fields(EngineArgs)}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        prompts = _as_list(prompts)
        params = _params_list(sampling_params, len(prompts))
        ids = [self._add(p, sp, final_only=True) for p, sp in zip(prompts, params, strict=True)]
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [
            tok.encode(
                tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt),
                add_special_tokens=False,
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it (text grows; the last
        one has ``finished=True``). ``text[len(previous.text):]`` is the new text."""
        rid = self._add(prompt, sampling_params or SamplingParams())
        try:
            while True:
                outs = [o for o in self.engine.step() if o.request_id == rid]
                for out in outs:
                    yield out
                    if out.finished:
                        return
                if not self.engine.has_unfinished_requests():
                    return
        finally:
            self.engine.abort_request(rid)

    def _add(self, prompt: Prompt, params: SamplingParams, final_only: bool = False) -> str:
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids") or prompt.get("prompt") or ""
        return self.engine.add_request(prompt, params, final_only=final_only)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm)
        try:
            while len(results) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for rid in ids:
                if rid not in results:
                    self.engine.abort_request(rid)
        return [results[rid] for rid in ids]


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt given as token ids
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    return prompts


def _params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
