"""Engine settings, fixed at start-up. Names follow vLLM where vLLM has one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # None: a default derived from max_model_len
    num_blocks: int | None = None  # overrides the memory budget (tests use it to force preemption)
