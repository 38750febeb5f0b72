"""Per-request sampling settings, named and validated as in vLLM's ``SamplingParams``."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastforward.structured_outputs import StructuredOutputsParams

# A bound on max_tokens that catches typos (1e9) without limiting real use; the engine
# additionally caps generation at the model's context length.
MAX_TOKENS_LIMIT = 1 << 20


@dataclass(slots=True)
class SamplingParams:
    """How to pick the next tokens and when to stop. Field names follow vLLM."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # DRY (llama.cpp's names and defaults, fastforward/layers/dry.py): a token extending a
    # repeat of at least dry_allowed_length tokens loses dry_multiplier * dry_base ** (length -
    # dry_allowed_length) of logit; 0 turns it off. dry_penalty_last_n: context tokens
    # searched (-1 all, 0 off).
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] = field(default_factory=lambda: ["\n", ":", '"', "*"])
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per generated token
    # Per prompt token (from the second on): its logprob and the top-N alternatives (vLLM).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Constrain the output to a JSON Schema / regex / choice / grammar (a dict of the same
    # fields is accepted).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.dry_sequence_breakers, str):
            self.dry_sequence_breakers = [self.dry_sequence_breakers]
        self.dry_sequence_breakers = list(self.dry_sequence_breakers or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.max_tokens is not None and self.max_tokens > MAX_TOKENS_LIMIT:
            raise ValueError(
                f"max_tokens={self.max_tokens} is absurd (limit {MAX_TOKENS_LIMIT}); "
                "use max_tokens=None to generate until the context is full"
            )
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not self.dry_multiplier >= 0.0:
            raise ValueError(f"dry_multiplier must be >= 0, got {self.dry_multiplier}")
        if not self.dry_base >= 1.0:
            raise ValueError(f"dry_base must be >= 1, got {self.dry_base}")
        if not isinstance(self.dry_allowed_length, int) or self.dry_allowed_length < 1:
            raise ValueError(f"dry_allowed_length must be >= 1, got {self.dry_allowed_length!r}")
        if not isinstance(self.dry_penalty_last_n, int) or self.dry_penalty_last_n < -1:
            raise ValueError(f"dry_penalty_last_n must be >= -1, got {self.dry_penalty_last_n!r}")
        if any(not isinstance(b, str) or not b for b in self.dry_sequence_breakers):
            raise ValueError("dry_sequence_breakers must be a list of non-empty strings")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams")
            self.structured_outputs.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
