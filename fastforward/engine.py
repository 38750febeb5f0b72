"""The engine loop: the one owner of the model, the KV cache and the scheduler.

``step()`` = schedule -> run the model on the flat batch -> sample -> update the scheduler ->
detokenize and check stop strings -> outputs. Everything outside talks to it through
``add_request`` / ``abort_request`` / ``step``.
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from fastforward import kernels
from fastforward.calibration import calibration_texts
from fastforward.config import SchedulerConfig
from fastforward.detokenizer import IncrementalDetokenizer
from fastforward.heap import trim_heap
from fastforward.hub import resolve_model
from fastforward.kernels.apply import (
    KernelReport,
    apply_cpu_kernels,
    cpu_has_native_bf16,
    kernels_usable,
)
from fastforward.kv.calibrate import CALIBRATION_TOKENS, calibrate_key_scales
from fastforward.kv.manager import KVCacheManager
from fastforward.kv.quant import is_quantized, resolve_kv_cache_dtype
from fastforward.kv.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVSpec,
    SlidingWindowSpec,
    make_kv_cache_config,
)
from fastforward.layers.sampler import FilterKernels, SampledToken, Sampler
from fastforward.loader.model_loader import load_model
from fastforward.models.config import ModelConfig
from fastforward.output_processor import OutputProcessor, ParentState, SequenceState
from fastforward.outputs import RequestOutput
from fastforward.request import Request, RequestStatus
from fastforward.runner import ModelRunner, StepResult
from fastforward.sampling_params import SamplingParams
from fastforward.scheduler import Scheduler, SchedulerStats
from fastforward.scoring import score_tokens
from fastforward.spec_decode.config import SpeculativeConfig
from fastforward.spec_decode.model_drafter import DraftModelProposer, LayerSkipProposer
from fastforward.spec_decode.proposer import NgramProposer, Proposer
from fastforward.spec_decode.verifier import DraftVerifier
from fastforward.structured_outputs import GrammarCompiler

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 1 << 30  # 1 GiB, grown if max_model_len needs more

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class EngineArgs:
    """Everything fixed at start-up. Names follow vLLM's engine arguments."""

    model: str = "smollm2-135m"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    seed: int = 0
    device: str = "cpu"
    download_progress: bool = True
    enable_prefix_caching: bool = True
    # Weight format (fastforward.quant.METHODS): int8, int4, int4-g64, int4-g128, codebook4,
    # codebook8, gguf; None keeps ``dtype`` weights. (A KV-cache dtype is a separate option.)
    quantization: str | None = None
    # KV cache storage (fastforward.kv.quant): auto keeps ``dtype``; int8 stores keys and values
    # with a scale per token and head, ~2x the tokens per byte.
    kv_cache_dtype: str = "auto"
    # auto: fastforward's C++ CPU kernels (paged attention; bf16 linears) where they build,
    # native: insist on them, torch: the plain PyTorch paths (the reference).
    kernels: str = "auto"
    # With the native kernels, decode-sized steps run all layers in one C++ call
    # (fastforward/kernels/decoder.py); False keeps the per-module path (to measure it).
    fused_layers: bool = True
    # On a Linux CPU, copy the weights into one buffer of 2 MiB pages and allocate the KV cache
    # in another (fastforward/huge_pages.py); False leaves both to PyTorch's allocator (to
    # measure what the pages gain).
    huge_pages: bool = True
    # Steps of plain greedy picks (no logprobs, penalties or grammar) for up to a few sequences
    # read an int8 copy of the output projection and compute in bf16 only the rows that could
    # be the largest: the same tokens (fastforward/layers/greedy_screen.py); False: every step
    # computes the full logits (to measure it), and no int8 copy is kept.
    greedy_screen: bool = True
    # Speculative decoding (fastforward.spec_decode.config.SpeculativeConfig, a dict of its
    # fields or their JSON): {"method": "ngram" | "draft_model" | "layer_skip",
    # "num_speculative_tokens": k, "model": draft, ...}; None: off.
    speculative_config: Any = None


def resolve_dtype(name: str | torch.dtype, fast_bf16: bool = False) -> torch.dtype:
    """``auto`` is bfloat16 where the CPU multiplies bf16 natively or our bf16 kernels run
    (``fast_bf16``), float32 elsewhere."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if fast_bf16 or cpu_has_native_bf16() else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported (choose auto, {', '.join(_DTYPES)})")
    return _DTYPES[name]


def kv_specs(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> list[KVSpec]:
    specs: list[KVSpec] = []
    for i in range(cfg.num_hidden_layers):
        window = cfg.window_of(i)
        args = (block_size, cfg.num_key_value_heads, cfg.head_dim, dtype)
        specs.append(
            SlidingWindowSpec(*args, sliding_window=window) if window else FullAttentionSpec(*args)
        )
    return specs


def token_texts(tokenizer: Any) -> list[str]:
    """The text of every vocabulary id (DRY's sequence breakers are found in them)."""
    backend = tokenizer.backend
    ids = [[i] for i in range(backend.get_vocab_size())]
    return backend.decode_batch(ids, skip_special_tokens=False)


class LLMEngine:
    """Loads a model and serves requests step by step."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.spec_config = SpeculativeConfig.parse(args.speculative_config)
        self._use_kernels, self._why_no_kernels = kernels_usable(args.kernels, self.device)
        self.dtype = resolve_dtype(args.dtype, fast_bf16=self._use_kernels)
        self.kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        path = resolve_model(args.model, progress=args.download_progress)
        loaded, self.kernels = self._load(path, args.quantization)
        self.model, self.model_config, self.tokenizer = (
            loaded.model,
            loaded.config,
            loaded.tokenizer,
        )
        self.quantization = loaded.quantization  # packed / left-float modules, or None
        self.max_model_len = self._resolve_max_model_len(args.max_model_len)
        self.kv_config = self._kv_config()
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len),
            KVCacheManager(
                self.kv_config,
                enable_caching=args.enable_prefix_caching,
                # Whatever besides the tokens decides the KV goes into every block hash.
                extra_key=f"model={path}|dtype={self.dtype}|kv_dtype={self.kv_dtype}"
                f"|weights={args.quantization}",
            ),
        )
        self.runner = ModelRunner(
            self.model,
            self.kv_config,
            self.device,
            args.fused_layers,
            args.huge_pages,
            args.greedy_screen,
        )
        trim_heap()  # start-up's freed temporaries (heap.py)
        # a function of the tokenizer alone: a bound method would make a reference cycle
        # through the engine, and engines (with their KV caches) would wait for the gc
        texts = functools.partial(token_texts, self.tokenizer)
        self.grammars = GrammarCompiler(
            self.tokenizer.backend,
            self.model_config.vocab_size,
            self.tokenizer.eos_token_id,
            token_texts=texts,
        )
        ops = kernels.ops() if self._use_kernels else None
        self.sampler = Sampler(
            seed=args.seed,
            grammars=self.grammars,
            token_texts=texts,
            argmax=ops.argmax_rows if ops else None,
            sample_logits=ops.sample_logits if ops else None,
            filter_kernels=FilterKernels.from_ops(ops) if ops else None,
        )
        self.verifier = DraftVerifier(self.sampler, self.grammars)
        self.proposer = self._make_proposer(self.spec_config)
        self._spec_tokens = self.spec_config.num_speculative_tokens if self.spec_config else 0
        self.output_processor = OutputProcessor(self.tokenizer)
        self.parents: dict[str, ParentState] = {}
        self.seq_states: dict[str, SequenceState] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------------ set-up

    def _load(self, path: str, quantization: str | None) -> tuple[Any, KernelReport]:
        loaded = load_model(path, self.dtype, self.device, quantization)
        if self._use_kernels:
            report = apply_cpu_kernels(loaded.model, self.dtype)
        else:
            report = KernelReport("torch", reason=self._why_no_kernels)
        if is_quantized(self.kv_dtype):
            texts = calibration_texts()
            if texts:  # else keys are quantized per token alone
                ids = loaded.tokenizer.encode(texts[0].text)[:CALIBRATION_TOKENS]
                calibrate_key_scales(loaded.model, ids, self.dtype, self.args.block_size)
        return loaded, report

    def _make_proposer(self, cfg: SpeculativeConfig | None) -> Proposer | None:
        if cfg is None:
            return None
        if cfg.method == "ngram":
            return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        num_layers = self.model_config.num_hidden_layers
        if cfg.method == "layer_skip":
            # Default: skip the middle quarter of the layers (the least missed without
            # early-exit training; docs/speculative.md has the measurements).
            skip = range(num_layers * 3 // 8, num_layers * 5 // 8)
            layer_ids = cfg.draft_layers or tuple(i for i in range(num_layers) if i not in skip)
            if max(layer_ids) >= num_layers or list(layer_ids) != sorted(set(layer_ids)):
                raise ValueError(
                    f"draft_layers must be increasing layer indices below {num_layers}, "
                    f"got {list(layer_ids)}"
                )
            return LayerSkipProposer(self.runner, self.scheduler.kv, self.sampler, layer_ids)
        return self._draft_model_proposer(cfg)

    def _draft_model_proposer(self, cfg: SpeculativeConfig) -> DraftModelProposer:
        path = resolve_model(cfg.model, progress=self.args.download_progress)
        loaded, _ = self._load(path, cfg.quantization)
        if loaded.config.vocab_size != self.model_config.vocab_size or (
            loaded.tokenizer.backend.get_vocab() != self.tokenizer.backend.get_vocab()
        ):
            raise ValueError(
                f"draft model {cfg.model!r} does not share the target's tokenizer "
                f"(vocab {loaded.config.vocab_size} vs {self.model_config.vocab_size})"
            )
        specs = kv_specs(loaded.config, self.args.block_size, self.kv_dtype)
        per_seq = -(-(cfg.num_speculative_tokens + 1) // self.args.block_size) + 1
        groups = len(make_kv_cache_config(specs, num_blocks=2).groups)
        num_blocks = 1 + groups * (
            self.kv_config.capacity_tokens // self.args.block_size
            + self.args.max_num_seqs * per_seq
        )
        kv_config = make_kv_cache_config(specs, num_blocks=num_blocks)
        runner = ModelRunner(  # drafts read logits (their probabilities): no greedy screen
            loaded.model,
            kv_config,
            self.device,
            self.args.fused_layers,
            self.args.huge_pages,
            greedy_screen=False,
        )
        kv = KVCacheManager(kv_config, enable_caching=False)
        return DraftModelProposer(runner, kv, self.sampler, self.args.max_num_batched_tokens)

    def _resolve_max_model_len(self, requested: int | None) -> int:
        limit = self.model_config.max_position_embeddings
        if requested is None:
            return limit
        if requested < 2:
            raise ValueError(f"max_model_len must be at least 2, got {requested}")
        if requested > limit:
            raise ValueError(f"max_model_len={requested} exceeds the model's context of {limit}")
        return requested

    def _kv_config(self) -> KVCacheConfig:
        specs = kv_specs(self.model_config, self.args.block_size, self.kv_dtype)
        if self.args.num_kv_blocks is not None:
            cfg = make_kv_cache_config(specs, num_blocks=self.args.num_kv_blocks)
        else:
            budget = self.args.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES
            cfg = make_kv_cache_config(specs, memory_bytes=budget)
            if self.args.kv_cache_memory_bytes is None and cfg.capacity_tokens < self.max_model_len:
                blocks = 1 + len(cfg.groups) * -(-self.max_model_len // self.args.block_size)
                cfg = make_kv_cache_config(specs, num_blocks=blocks)
        if cfg.capacity_tokens < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {cfg.capacity_tokens} tokens per sequence, less than "
                f"max_model_len={self.max_model_len}: give it more memory or lower max_model_len"
            )
        return cfg

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        final_only: bool = False,
    ) -> str:
        """Validate and enqueue a request; returns its id. Raises ``ValueError`` on bad input.

        ``final_only``: ``step()`` returns the request's output once, when it finishes, instead
        of after every step that changed it (``LLM.generate``'s use, as vLLM's FINAL_ONLY
        output kind): no output built for a step nobody reads (at 64 sequences ~0.6 ms of a
        ~60 ms decode step went to building them)."""
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling params must be a SamplingParams")
        params.validate()
        prompt_text, prompt_ids = self._tokenize(prompt)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs)
        parent = ParentState(request_id, prompt_text, prompt_ids, final_only=final_only)
        for i in range(params.n):
            seq = self._make_sequence(parent, i, params)
            if grammar is not None:
                seq.request.grammar = self.grammars.matcher(grammar)
            parent.sequences.append(seq)
        self.parents[request_id] = parent
        for seq in parent.sequences:
            self.seq_states[seq.request.request_id] = seq
            self.scheduler.add_request(seq.request)
        return request_id

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        elif isinstance(prompt, list | tuple):
            ids, text = list(prompt), None
            vocab = self.model_config.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        else:
            raise ValueError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens, but the model's context (max_model_len) is "
                f"{self.max_model_len} tokens and at least one token must be generated"
            )
        return text, ids

    def _make_sequence(
        self, parent: ParentState, index: int, params: SamplingParams
    ) -> SequenceState:
        child_params = self._child_params(params, index)
        room = self.max_model_len - len(parent.prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        rid = parent.request_id if params.n == 1 else f"{parent.request_id}#{index}"
        req = Request(
            request_id=rid,
            prompt_token_ids=list(parent.prompt_token_ids),
            sampling_params=child_params,
            eos_token_id=self.tokenizer.eos_token_id,
            max_tokens=max_tokens,
        )
        detok = IncrementalDetokenizer(self.tokenizer, parent.prompt_token_ids, child_params)
        logprobs = [] if params.logprobs is not None else None
        return SequenceState(req, detok, logprobs=logprobs)

    def _child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        # Other end-of-turn tokens of the model stop generation too (as generation_config does).
        extra_eos = sorted(self.tokenizer.eos_token_ids - {self.tokenizer.eos_token_id})
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += [t for t in extra_eos if t not in stop_ids]
        seed = None if params.seed is None else params.seed + index
        return replace(params, n=1, seed=seed, stop_token_ids=stop_ids)

    def abort_request(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return
        ids = [s.request.request_id for s in parent.sequences]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            self.seq_states.pop(rid, None)
        self._release_drafts()

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs of requests that progressed."""
        self._propose()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        try:
            result = self.runner.execute(sched, screen_greedy=True)
            with torch.inference_mode():  # the runner's logits are processed in place
                sampled = self._sample(result)
        except Exception as e:  # never leave requests hanging on a failed step
            logger.exception("engine step failed")
            return self._fail([s.request for s in sched.scheduled], f"engine error: {e}")
        for rid, scored in result.prompt_logprobs.items():
            self.seq_states[rid].request.prompt_logprobs.extend(scored)
        by_id = {r.request_id: toks for r, toks in zip(result.requests, sampled, strict=True)}
        before = {r.request_id: r.num_output_tokens for r in result.requests}
        updated = self.scheduler.update(
            sched, {rid: [t.token_id for t in toks] for rid, toks in by_id.items()}
        )
        touched: dict[str, ParentState] = {}
        broken = []
        for req in updated:
            seq = self.seq_states[req.request_id]
            # Tokens after one that stopped the request were dropped by the scheduler.
            gained = by_id[req.request_id][: req.num_output_tokens - before[req.request_id]]
            for tok in gained:
                self.output_processor.record_logprobs(seq, tok)
            if req.grammar is not None and not self._advance_grammars(req, gained):
                broken.append(req)
            self._process_text(seq)
            parent = self._parent_of(req.request_id)
            touched[parent.request_id] = parent
        for req in broken:
            if not req.is_finished:
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR)
            parent = self._parent_of(req.request_id)
            parent.error = f"structured output: {req.grammar.get_error() or 'token rejected'}"
            touched[parent.request_id] = parent
        self._release_drafts()
        return [self._emit(p) for p in touched.values() if p.finished or not p.final_only]

    @staticmethod
    def _advance_grammars(req: Request, gained: list[SampledToken]) -> bool:
        """Feed a structured-output request the tokens it gained; False when its matcher
        rejects one (which the mask should make impossible)."""
        return all(req.grammar.consume_token(t.token_id) for t in gained)

    def _sample(self, result: StepResult) -> list[list[SampledToken]]:
        """The tokens each request of the step gains: one sampled token, or for a request
        verifying drafts the accepted ones and one more."""
        reqs, ks = result.requests, result.num_spec
        if result.tokens is not None:  # the greedy screen's picks (plain greedy requests)
            return [[SampledToken(token_id=t)] for t in result.tokens.tolist()]
        if not any(ks):
            return [[t] for t in self.sampler(result.logits, reqs, owned=True)]
        starts = np.concatenate([[0], np.cumsum(np.asarray(ks) + 1)])
        out: list[list[SampledToken]] = [[] for _ in reqs]
        plain = [i for i, k in enumerate(ks) if k == 0]
        if plain:
            plain_logits = result.logits[starts[plain]]  # a copy: advanced indexing
            rows = self.sampler(plain_logits, [reqs[i] for i in plain], owned=True)
            for i, tok in zip(plain, rows, strict=True):
                out[i] = [tok]
        spec = [i for i, k in enumerate(ks) if k > 0]
        rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in spec])
        verified = self.verifier(
            result.logits[torch.from_numpy(rows)], [reqs[i] for i in spec], [ks[i] for i in spec]
        )
        for i, toks in zip(spec, verified, strict=True):
            out[i] = toks
        return out

    def set_speculative_tokens(self, k: int) -> None:
        """Change the number of draft tokens per step at run time (0: no speculation), e.g.
        to sweep k without reloading the models."""
        if self.spec_config is None:
            raise ValueError("the engine was started without a speculative_config")
        if not isinstance(k, int) or not 0 <= k <= 16:
            raise ValueError(f"the number of speculative tokens must be in [0, 16], got {k!r}")
        self._spec_tokens = k

    def _propose(self) -> None:
        """Drafts for the running requests that are decoding, verified by the next step."""
        if self.proposer is None or not self._spec_tokens:
            return
        cfg = self.spec_config
        running = self.scheduler.running
        if cfg.disable_by_batch_size is not None and len(running) > cfg.disable_by_batch_size:
            return
        cands, ks = [], []
        for r in running:
            k = self._num_drafts(r) if r.num_tokens - r.num_computed_tokens == 1 else 0
            if k > 0:
                cands.append(r)
                ks.append(k)
        if not cands:
            return
        try:
            drafts = self.proposer.propose(cands, ks)
        except Exception:  # a failed draft costs speed, never the request
            logger.exception("speculative proposer failed; this step runs without drafts")
            return
        for r, k, d in zip(cands, ks, drafts, strict=True):
            toks = d.token_ids[:k]
            if r.grammar is not None and toks:  # drafts the grammar forbids are never verified
                toks = toks[: r.grammar.validate_tokens(toks)]
            r.spec_token_ids = toks
            r.spec_draft_probs = d.probs[: len(toks)] if d.probs is not None and toks else None

    def _release_drafts(self) -> None:
        """Drafter state (a draft model's KV) is kept for running requests only."""
        if self.proposer is not None:
            self.proposer.release({r.request_id for r in self.scheduler.running})

    def _num_drafts(self, r: Request) -> int:
        """k for this request: the configured number (adaptive: one more than its mean
        accepted run so far), within what it may still generate and the context."""
        cfg = self.spec_config
        k = self._spec_tokens
        if cfg.adaptive and r.num_spec_steps:
            k = max(1, min(k, int(r.num_accepted_tokens / r.num_spec_steps) + 1))
        room = min(r.max_tokens - r.num_output_tokens, self.max_model_len - r.num_tokens) - 1
        so = r.sampling_params.structured_outputs
        if so is not None:  # the finish window is sampled token by token, never drafted
            room -= so.finish_reserve
        return max(0, min(k, room))

    def _process_text(self, seq: SequenceState) -> None:
        stop = self.output_processor.process(seq)
        req = seq.request
        # A complete grammar ends the request: nothing more may follow.
        grammar_done = (
            stop is None
            and req.grammar is not None
            and not req.is_finished
            and req.grammar.is_stopped()
        )
        if stop is None and not grammar_done:
            return
        # A grammar completed under steering was cut short by the budget (finish_reserve)
        status = (
            RequestStatus.FINISHED_LENGTH
            if grammar_done and req.finish_steered
            else RequestStatus.FINISHED_STOPPED
        )
        if not req.is_finished:
            self.scheduler.finish_requests([req.request_id], status)
        req.status = status
        if grammar_done:
            self.output_processor.process(seq)  # now finished: flush the held-back text
        else:
            req.stop_reason = stop

    def _parent_of(self, rid: str) -> ParentState:
        return self.parents[rid.rsplit("#", 1)[0] if rid not in self.parents else rid]

    def _emit(self, parent: ParentState) -> RequestOutput:
        out = self.output_processor.make_output(parent)
        if parent.finished:
            self.parents.pop(parent.request_id, None)
            for seq in parent.sequences:
                self.seq_states.pop(seq.request.request_id, None)
        return out

    def _fail(self, requests: list[Request], message: str) -> list[RequestOutput]:
        parents = {
            self._parent_of(r.request_id).request_id: self._parent_of(r.request_id)
            for r in requests
        }
        outs = []
        for parent in parents.values():
            parent.error = message
            ids = [s.request.request_id for s in parent.sequences]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
            outs.append(self._emit(parent))
        self._release_drafts()
        return outs

    # ------------------------------------------------------------------ scoring

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Log-probabilities of each next token of ``token_ids`` (``[len - 1]`` float32), from
        one pass over a KV allocation of its own: the serving cache is not touched."""
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"{len(token_ids)} tokens exceed max_model_len={self.max_model_len}")
        return score_tokens(self.model, token_ids, self.kv_dtype, self.args.block_size)

    # ------------------------------------------------------------------ stats

    def get_stats(self) -> SchedulerStats:
        """Queue lengths, KV usage, preemptions and prefix-cache queries/hits (tokens)."""
        return self.scheduler.get_stats()
