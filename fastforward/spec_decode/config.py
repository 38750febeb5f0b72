"""``speculative_config``: which proposer drafts tokens and how many, as in vLLM."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "layer_skip")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How the engine speculates. ``method`` is inferred as ``draft_model`` when only ``model``
    is given (vLLM's convention).

    - ``ngram``: prompt lookup; the last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens are
      matched against the earlier tokens of the request and what followed the latest match is
      proposed.
    - ``draft_model``: a smaller model sharing the target's tokenizer (``model``, optionally
      ``quantization``) with its own paged KV cache.
    - ``layer_skip``: the target itself drafts through ``draft_layers`` of its layers (default:
      all but the middle quarter) and reads the target's KV cache for the context.

    ``adaptive``: each request proposes one token more than its mean accepted run so far,
    between 1 and ``num_speculative_tokens``. ``disable_by_batch_size``: no speculation in steps
    where more requests than this are running (None: always). Verifying ``k`` drafts of a
    large batch turns a memory-bound step into a compute-bound one: on a 2-core Xeon n-gram
    lookup with k = 4 gave 1.59x at 32 requests and 1.01x at 64 (docs/speculative.md), hence
    the default of 48.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None
    quantization: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_layers: tuple[int, ...] | None = None
    adaptive: bool = False
    disable_by_batch_size: int | None = 48

    @classmethod
    def parse(
        cls, value: SpeculativeConfig | dict[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """From a config, a dict, or its JSON text (the CLI's ``--speculative-config``)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object / dict")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative_config key(s): {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known))})"
            )
        value = dict(value)
        if "method" not in value and value.get("model"):
            value["method"] = "draft_model"
        if isinstance(value.get("draft_layers"), list):
            value["draft_layers"] = tuple(value["draft_layers"])
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is unknown (choose {', '.join(METHODS)})"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method draft_model needs a 'model'")
        if self.method != "draft_model" and self.model:
            raise ValueError(f"speculative method {self.method} takes no 'model'")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}"
            )
        if self.draft_layers is not None and (
            not self.draft_layers or any(not isinstance(i, int) or i < 0 for i in self.draft_layers)
        ):
            raise ValueError("draft_layers must be a non-empty list of layer indices")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1")
