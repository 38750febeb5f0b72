"""From OpenAI requests to engine requests, and from engine outputs to OpenAI responses."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastforward.outputs import CompletionOutput, Logprob, RequestOutput
from fastforward.sampling_params import SamplingParams
from fastforward.server.protocol import ChatCompletionRequest, CompletionRequest
from fastforward.structured_outputs import StructuredOutputsParams


class APIError(Exception):
    """An error the client caused or must handle, rendered as OpenAI's error JSON."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.kind = kind or {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            413: "invalid_request_error",
            503: "service_unavailable",
        }.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
) -> SamplingParams:
    if req.logit_bias:
        raise APIError("logit_bias is not supported", param="logit_bias")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            n=req.n,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            dry_multiplier=req.dry_multiplier,
            dry_base=req.dry_base,
            dry_allowed_length=req.dry_allowed_length,
            dry_penalty_last_n=req.dry_penalty_last_n,
            **(
                {}
                if req.dry_sequence_breakers is None
                else {"dry_sequence_breakers": req.dry_sequence_breakers}
            ),
            seed=req.seed,
            stop=stop,
            stop_token_ids=req.stop_token_ids or [],
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            structured_outputs=structured_outputs(req),
        )
    except ValueError as e:
        message = str(e)
        # SamplingParams names the field first: "top_p must be ...", "max_tokens=9 is ..."
        field_name = re.match(r"[a-z_]+", message)
        raise APIError(message, param=field_name.group(0) if field_name else None) from None


_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *_GUIDED)


def structured_outputs(
    req: CompletionRequest | ChatCompletionRequest,
) -> StructuredOutputsParams | None:
    """The one output constraint of a request, from ``response_format`` (OpenAI),
    ``structured_outputs`` or ``guided_*`` (vLLM); a 400 naming the field when it is unclear."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    for name in _CONSTRAINT_FIELDS:
        value = getattr(req, name)
        if value is None:
            continue
        try:
            if name == "response_format":
                so = _response_format(value)
            elif name == "structured_outputs":
                so = StructuredOutputsParams(**value)
            else:
                so = StructuredOutputsParams(**{_GUIDED[name]: value})
        except (TypeError, ValueError) as e:
            raise APIError(f"{name}: {e}", param=name) from None
        if so is not None:
            found.append((name, so))
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise APIError(f"give one output constraint, not several ({names})", param=found[1][0])
    if req.finish_reserve is None:
        return found[0][1] if found else None
    if not found:
        raise APIError(
            "finish_reserve applies to constrained outputs: give response_format, "
            "structured_outputs or guided_* too",
            param="finish_reserve",
        )
    name, so = found[0]
    if so.finish_reserve not in (0, req.finish_reserve):
        raise APIError(
            f"finish_reserve={req.finish_reserve} differs from {name}.finish_reserve="
            f"{so.finish_reserve}",
            param="finish_reserve",
        )
    so.finish_reserve = req.finish_reserve
    return so


def constraint_field(req: CompletionRequest | ChatCompletionRequest) -> str:
    """The request field that carries its output constraint (for error messages)."""
    return next(
        (n for n in _CONSTRAINT_FIELDS if getattr(req, n) is not None), _CONSTRAINT_FIELDS[0]
    )


def _response_format(fmt: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError("json_schema needs a 'schema' (as {'name': ..., 'schema': {...}})")
        return StructuredOutputsParams(json=spec["schema"])
    raise ValueError(f"type must be text, json_object or json_schema, got {kind!r}")


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    """A prompt (plus the asked-for completion) must fit the context, as in vLLM's server."""
    asked = prompt_len + (max_tokens or 1)
    if prompt_len >= max_model_len or asked > max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {asked} tokens ({prompt_len} in the prompt, {max_tokens or 1} for the "
            "completion). Please reduce the length of the prompt or completion.",
            param="messages" if max_tokens is None else "max_tokens",
        )


@dataclass(slots=True)
class ChoiceState:
    """Streaming bookkeeping of one choice: how much text/tokens were already sent."""

    sent_text: int = 0
    sent_tokens: int = 0
    sent_role: bool = False
    sent_echo: bool = False  # completions with echo: the prompt went out in the first chunk
    finished: bool = False


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    extras: dict[str, Any] = field(default_factory=dict)

    def add(self, out: RequestOutput) -> None:
        self.prompt_tokens += len(out.prompt_token_ids)
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        self.cached_tokens += out.num_cached_tokens
        self.extras = engine_report(out)

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "fastforward": self.extras,
        }


def engine_report(out: RequestOutput) -> dict[str, Any]:
    """What the engine did for this request: cache reuse, timing, speed."""
    m = out.metrics
    report: dict[str, Any] = {
        "cached_prompt_tokens": out.num_cached_tokens,
        "generated_tokens": sum(len(c.token_ids) for c in out.outputs),
    }
    if m is None:
        return report
    report["num_preemptions"] = m.num_preemptions
    if m.num_spec_steps:
        report["speculative"] = {
            "draft_tokens": m.num_draft_tokens,
            "accepted_tokens": m.num_accepted_tokens,
            "acceptance_rate": round(m.spec_acceptance_rate or 0.0, 4),
            "mean_accepted_length": round(1 + m.num_accepted_tokens / m.num_spec_steps, 4),
        }
    if m.first_scheduled_time is not None:
        report["queue_time_s"] = round(m.first_scheduled_time - m.arrival_time, 6)
    if m.first_token_time is not None:
        report["time_to_first_token_s"] = round(m.first_token_time - m.arrival_time, 6)
        n = max(len(c.token_ids) for c in out.outputs)
        if m.finished_time is not None and n > 1 and m.finished_time > m.first_token_time:
            report["decode_tokens_per_s"] = round(
                (n - 1) / (m.finished_time - m.first_token_time), 3
            )
    return report


# ---- logprobs in the two OpenAI shapes ------------------------------------------------------


def completion_logprobs(
    token_ids: list[int],
    entries: list[dict[int, Logprob] | None],
    text_offset: int,
    piece: Callable[[int], str],
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` of ``token_ids``, text offsets from ``text_offset``.
    An entry of ``None`` (the first prompt token of an echo: nothing predicts it) gives a null
    logprob and null top alternatives; ``piece`` spells a token no entry spells."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for token_id, entry in zip(token_ids, entries, strict=False):
        scored = (entry.get(token_id) or Logprob(float("nan"))) if entry is not None else None
        text = scored.decoded_token if scored and scored.decoded_token is not None else None
        text = piece(token_id) if text is None else text
        tokens.append(text)
        token_lps.append(scored.logprob if scored else None)
        tops.append(
            {lp.decoded_token or "": lp.logprob for lp in _ranked(entry)}
            if entry is not None
            else None
        )
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def join_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {k: first[k] + second[k] for k in first}


def chat_logprobs(c: CompletionOutput, start: int, top_n: int) -> dict[str, Any]:
    content = []
    for token_id, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:], strict=False):
        sampled = entry.get(token_id) or Logprob(float("nan"))
        piece = sampled.decoded_token or ""
        content.append(
            {
                "token": piece,
                "logprob": sampled.logprob,
                "bytes": list(piece.encode()),
                "top_logprobs": [
                    {
                        "token": lp.decoded_token or "",
                        "logprob": lp.logprob,
                        "bytes": list((lp.decoded_token or "").encode()),
                    }
                    for lp in _ranked(entry)[:top_n]
                ],
            }
        )
    return {"content": content}


def _ranked(entry: dict[int, Logprob]) -> list[Logprob]:
    return sorted(entry.values(), key=lambda lp: (lp.rank or 10**9, -lp.logprob))


def created() -> int:
    return int(time.time())
