"""The FastAPI application: OpenAI-compatible routes, errors, metrics and the playground.

Handlers only validate, tokenize, enqueue and stream; the engine thread does the rest.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastforward.outputs import CompletionOutput, RequestOutput
from fastforward.sampling_params import SamplingParams
from fastforward.server.async_engine import AsyncEngine, QueueFullError
from fastforward.server.openai_api import (
    APIError,
    ChoiceState,
    Usage,
    chat_logprobs,
    check_context,
    completion_logprobs,
    constraint_field,
    created,
    join_logprobs,
    new_id,
    sampling_params,
)
from fastforward.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

logger = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"


@dataclass(slots=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    retry_after_s: int = 1


class GuardMiddleware:
    """API key and body size checks, as plain ASGI so streaming and disconnects pass through."""

    def __init__(self, app, config: ServerConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        if self.config.api_key and headers.get("authorization") != f"Bearer {self.config.api_key}":
            err = APIError("Invalid or missing API key", status=401)
            return await _json(err.body(), 401)(scope, receive, send)
        limit = self.config.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _json(_too_large(limit).body(), 413)(scope, receive, send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return await _json(_too_large(limit).body(), 413)(scope, receive, send)
        first = {"type": "http.request", "body": bytes(body), "more_body": False}
        return await self.app(scope, _replay([first], receive), send)


def _replay(messages: list[dict], then=None):
    async def receive():
        if messages:
            return messages.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}

    return receive


def _too_large(limit: int) -> APIError:
    return APIError(f"request body is larger than the limit of {limit} bytes", status=413)


def _json(body: dict, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _encode(tokenizer, text: str, param: str, **kwargs: Any) -> list[int]:
    """Tokenize request text. Text that is not valid Unicode (a lone surrogate, which a JSON
    ``\\ud800`` escape can carry) is a 400 naming ``param``, not a tokenizer crash (500)."""
    try:
        return tokenizer.encode(text, **kwargs)
    except (TypeError, UnicodeError):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(
                f"{param} is not valid Unicode text ({e.reason} at position {e.start})",
                param=param,
            ) from None
        raise


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="fastforward", version="0.1.0")
    api = OpenAIServing(engine, config)
    _install_error_handlers(app, config)

    @app.get("/health")
    async def health() -> JSONResponse:
        return _json(
            {"status": "ok" if engine.healthy else "error"}, 200 if engine.healthy else 503
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return api.models()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await api.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        return await api.chat(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return api.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        return api.detokenize(req)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return api.tokenizer_info()

    return GuardMiddleware(app, config)  # type: ignore[return-value]


# pydantic puts the member of a union that failed into an error's location ("prompt.str",
# "stop.list[str]", "messages.0.content.str"); these are types, not fields of the request.
_UNION_TAG = re.compile(r"^(str|int|float|bool|bytes|none|[a-z_-]+\[.*\]|function-.*|[A-Z]\w*)$")


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One OpenAI-style message and ``param`` (the field's dotted path) for pydantic errors."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", first.get("msg", ""))
        return f"the request body is not valid JSON: {reason}", None

    def path(err: dict[str, Any]) -> str | None:
        loc = list(err.get("loc", ()))
        if loc and loc[0] == "body":
            loc = loc[1:]
        parts = []
        for p in loc:
            if isinstance(p, str) and _UNION_TAG.match(p):
                break  # the rest describes a union member, not the request
            parts.append(str(p))
        return ".".join(parts) or None

    param = path(first)
    if param is None:
        return f"the request body must be a JSON object: {first.get('msg', '')}", None
    # A union reports one error per member: say them all, once.
    msgs = list(dict.fromkeys(e.get("msg", "invalid value") for e in errors if path(e) == param))
    return f"{param}: {' or '.join(msgs)}", param


def _install_error_handlers(app: FastAPI, config: ServerConfig) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc.errors())
        return _json(APIError(message, param=param).body(), 400)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _json(exc.body(), exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown paths (404) and wrong methods (405) answer in OpenAI's error shape too.
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(str(exc.detail), status=exc.status_code, kind=kind)
        return _json(err.body(), exc.status_code, exc.headers)

    @app.exception_handler(QueueFullError)
    async def busy(_: Request, exc: QueueFullError) -> JSONResponse:
        headers = {"Retry-After": str(config.retry_after_s)}
        return _json(APIError(str(exc), status=503).body(), 503, headers)

    @app.exception_handler(ValueError)
    async def bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return _json(APIError(str(exc)).body(), 400)

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled server error")
        return _json(APIError(f"internal error: {exc}", status=500).body(), 500)


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len

    def models(self) -> dict[str, Any]:
        card = {
            "id": self.config.served_model_name,
            "object": "model",
            "created": created(),
            "owned_by": "fastforward",
            "max_model_len": self.max_model_len,
        }
        return {"object": "list", "data": [card]}

    def _check_model(self, model: str | None) -> None:
        if model and model != self.config.served_model_name:
            raise APIError(
                f"The model `{model}` does not exist (this server serves "
                f"`{self.config.served_model_name}`)",
                status=404,
                param="model",
            )

    # ---- /v1/completions ---------------------------------------------------------------

    async def completions(self, req: CompletionRequest, raw: Request):
        self._check_model(req.model)
        if req.suffix:
            raise APIError("suffix is not supported yet", param="suffix")
        if req.best_of not in (None, 1, req.n):
            raise APIError("best_of is not supported", param="best_of")
        if req.max_tokens == 0 and not req.echo:
            raise APIError("max_tokens must be at least 1 (0 only with echo)", param="max_tokens")
        prompts = self._completion_prompts(req.prompt)
        # max_tokens=0 with echo scores the prompt only: one token is computed and dropped.
        params = sampling_params(req, req.max_tokens or 1, req.logprobs)
        if req.echo and req.logprobs is not None:
            params.prompt_logprobs = req.logprobs
        await self._compile_constraint(req, params)
        for _, ids in prompts:
            check_context(len(ids), req.max_tokens or 1, self.max_model_len)
        rid = new_id("cmpl")
        gens = [
            self.engine.generate(ids, params, f"{rid}-{i}", text)
            for i, (text, ids) in enumerate(prompts)
        ]
        echoes = [text if text is not None else self._decode(ids) for text, ids in prompts]
        if req.stream:
            first = await _first_outputs(gens)
            return StreamingResponse(
                self._stream_completion(rid, req, params, gens, first, echoes),
                media_type="text/event-stream",
            )
        finals = await _collect(gens, raw)
        return self._completion_body(rid, req, params, finals, echoes)

    async def _compile_constraint(self, req, params: SamplingParams) -> None:
        """Compile a schema/regex/grammar off the event loop (the engine then finds it cached);
        a bad one is a 400 naming the request field."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(self.engine.engine.grammars.compile, params.structured_outputs)
        except ValueError as e:
            field = constraint_field(req)
            raise APIError(f"{field}: {e}", param=field) from None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_choice(
        self,
        req: CompletionRequest,
        out: RequestOutput,
        c: CompletionOutput,
        sent: ChoiceState,
        echo: str | None,
    ) -> tuple[str, dict[str, Any] | None]:
        """Text and legacy logprobs of one choice past what ``sent`` says was sent. With
        ``echo`` (the prompt) the first chunk starts with it and text offsets count it.
        ``max_tokens=0`` drops the generated part."""
        keep = req.max_tokens != 0
        text = c.text[sent.sent_text :] if keep else ""
        with_prompt = echo is not None and not sent.sent_echo
        sent.sent_echo = sent.sent_echo or with_prompt
        lp = None
        if req.logprobs is not None:
            offset = sent.sent_text + (len(echo) if echo is not None else 0)
            n = len(c.token_ids) if keep else sent.sent_tokens  # max_tokens=0: none of them
            generated = (c.logprobs or [])[sent.sent_tokens : n]
            lp = completion_logprobs(
                c.token_ids[sent.sent_tokens : n], generated, offset, self._piece
            )
            if with_prompt:
                prompt = out.prompt_token_ids
                entries = out.prompt_logprobs or [None] * len(prompt)
                lp = join_logprobs(completion_logprobs(prompt, entries, 0, self._piece), lp)
        return (echo if with_prompt else "") + text, lp

    def _completion_prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError("prompt is empty", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        out = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise APIError("prompt is empty", param="prompt")
                out.append((p, _encode(self.tokenizer, p, "prompt")))
            else:
                if not p:
                    raise APIError("prompt is empty", param="prompt")
                vocab = self.engine.engine.model_config.vocab_size
                if any(t < 0 or t >= vocab for t in p):
                    raise APIError(f"prompt token ids must be in [0, {vocab})", param="prompt")
                out.append((None, list(p)))
        return out

    def _completion_body(
        self,
        rid: str,
        req: CompletionRequest,
        params: SamplingParams,
        finals: list[RequestOutput],
        echoes: list[str],
    ) -> dict[str, Any]:
        choices, usage = [], Usage()
        for i, out in enumerate(finals):
            usage.add(out)
            for c in out.outputs:
                echo = echoes[i] if req.echo else None
                text, lp = self._completion_choice(req, out, c, ChoiceState(), echo)
                choices.append(
                    {
                        "index": i * params.n + c.index,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        return {
            "id": rid,
            "object": "text_completion",
            "created": created(),
            "model": self.config.served_model_name,
            "choices": choices,
            "usage": usage.body(),
        }

    async def _stream_completion(self, rid, req, params, gens, first, echoes) -> AsyncIterator[str]:
        states: dict[int, ChoiceState] = {}
        usage = Usage()
        base = {
            "id": rid,
            "object": "text_completion",
            "created": created(),
            "model": self.config.served_model_name,
        }
        try:
            async for i, out in _merge(gens, first):
                for c in out.outputs:
                    idx = i * params.n + c.index
                    st = states.setdefault(idx, ChoiceState())
                    if st.finished:
                        continue
                    echo = echoes[i] if req.echo else None
                    delta, lp = self._completion_choice(req, out, c, st, echo)
                    if delta or c.finish_reason or (lp and lp["tokens"]):
                        choice = {
                            "index": idx,
                            "text": delta,
                            "logprobs": lp,
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                        }
                        yield _sse({**base, "choices": [choice]})
                    st.sent_text, st.sent_tokens = len(c.text), len(c.token_ids)
                    st.finished = c.finish_reason is not None
                if out.finished:
                    usage.add(out)
            if req.stream_options and req.stream_options.include_usage:
                yield _sse({**base, "choices": [], "usage": usage.body()})
        except Exception as e:  # noqa: BLE001 - reported to the client in-band
            yield _sse(APIError(str(e), status=500).body())
        yield "data: [DONE]\n\n"

    # ---- /tokenize, /detokenize (vLLM) -------------------------------------------------

    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            text = self._chat_text(req.messages, req.add_generation_prompt, None)
            ids = _encode(self.tokenizer, text, "messages", add_special_tokens=False)
        else:
            ids = _encode(
                self.tokenizer, req.prompt, "prompt", add_special_tokens=req.add_special_tokens
            )
        body: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.max_model_len,
            "tokens": ids,
        }
        body["token_strs"] = (
            self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        )
        return body

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        vocab = self.engine.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token ids must be in [0, {vocab}), got {bad[0]}", param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's ``/tokenizer_info``: the special tokens and chat template, which is what
        lm-evaluation-harness's ``tokenizer_backend=remote`` reads (with ``/tokenize``)."""
        tok = self.tokenizer

        def text(token_id: int | None) -> str | None:
            return None if token_id is None else tok.id_to_token(token_id)

        return {
            "tokenizer_class": type(tok).__name__,
            "bos_token": text(tok.bos_token_id),
            "eos_token": text(tok.eos_token_id),
            "pad_token": text(tok.pad_token_id),
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "add_bos_token": tok.add_bos_token,
            "add_eos_token": tok.add_eos_token,
            "chat_template": tok.chat_template,
            "model_max_length": self.max_model_len,
            "vocab_size": self.engine.engine.model_config.vocab_size,
        }

    def _chat_text(self, messages, add_generation_prompt: bool, tools) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                [m.model_dump(exclude_none=True) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=tools,
            )
        except ValueError as e:
            raise APIError(str(e), param="messages") from None

    # ---- /v1/chat/completions ----------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        self._check_model(req.model)
        text = self._chat_text(req.messages, req.add_generation_prompt, req.tools)
        ids = _encode(self.tokenizer, text, "messages", add_special_tokens=False)
        max_tokens = req.max_completion_tokens or req.max_tokens
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
        params = sampling_params(req, max_tokens, top if req.logprobs else None)
        check_context(len(ids), max_tokens, self.max_model_len)
        await self._compile_constraint(req, params)
        rid = new_id("chatcmpl")
        gens = [self.engine.generate(ids, params, rid, text)]
        if req.stream:
            first = await _first_outputs(gens)
            return StreamingResponse(
                self._stream_chat(rid, req, params, gens, first), media_type="text/event-stream"
            )
        out = (await _collect(gens, raw))[0]
        usage = Usage()
        usage.add(out)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c, 0, top) if req.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in out.outputs
        ]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created(),
            "model": self.config.served_model_name,
            "choices": choices,
            "usage": usage.body(),
        }

    async def _stream_chat(self, rid, req, params, gens, first) -> AsyncIterator[str]:
        base = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created(),
            "model": self.config.served_model_name,
        }
        states = [ChoiceState() for _ in range(params.n)]
        top = req.top_logprobs or 0
        usage = Usage()
        try:
            for i in range(params.n):
                role = {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield _sse({**base, "choices": [role]})
            async for _, out in _merge(gens, first):
                for c in out.outputs:
                    st = states[c.index]
                    if st.finished:
                        continue
                    delta = c.text[st.sent_text :]
                    lp = chat_logprobs(c, st.sent_tokens, top) if req.logprobs else None
                    if delta or c.finish_reason or (lp and lp["content"]):
                        choice = {
                            "index": c.index,
                            "delta": {"content": delta} if delta else {},
                            "logprobs": lp,
                            "finish_reason": c.finish_reason,
                        }
                        yield _sse({**base, "choices": [choice]})
                    st.sent_text, st.sent_tokens = len(c.text), len(c.token_ids)
                    st.finished = c.finish_reason is not None
                if out.finished:
                    usage.add(out)
            if req.stream_options and req.stream_options.include_usage:
                yield _sse({**base, "choices": [], "usage": usage.body()})
        except Exception as e:  # noqa: BLE001 - reported to the client in-band
            yield _sse(APIError(str(e), status=500).body())
        yield "data: [DONE]\n\n"


# ---- driving several request generators ----------------------------------------------------


async def _first_outputs(gens: list) -> list:
    """Start every request now, so validation errors become HTTP errors before streaming."""
    firsts = []
    try:
        for g in gens:
            firsts.append(await g.__anext__())
            if firsts[-1].error:  # failed before anything was sent: a plain HTTP error
                raise APIError(f"the engine failed the request: {firsts[-1].error}", status=500)
    except BaseException:
        for g in gens:
            await g.aclose()
        raise
    return firsts


def _raise_if_failed(out: RequestOutput) -> None:
    if out.error:
        raise RuntimeError(f"the engine failed the request: {out.error}")


async def _merge(gens: list, firsts: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the outputs of several requests as they come; aborts all on early exit."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
        except Exception as e:  # noqa: BLE001
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = []
    try:  # from the first yield on: whatever ends this early must abort every request
        for i, first in enumerate(firsts):
            _raise_if_failed(first)
            yield i, first
            if not first.finished:
                tasks.append(asyncio.create_task(pump(i, gens[i])))
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                _raise_if_failed(item)
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()


async def _collect(gens: list, raw: Request) -> list[RequestOutput]:
    """Run requests to completion; abort them if the client goes away meanwhile."""

    async def last(gen) -> RequestOutput:
        out = None
        async for out in gen:  # noqa: B007 - we want the final output
            pass
        return out

    tasks = [asyncio.create_task(last(g)) for g in gens]
    try:
        while True:
            done, _ = await asyncio.wait(tasks, timeout=1.0, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:  # e.g. one prompt of a list hit the queue bound:
                    raise t.exception()  # fail now; the finally aborts the other prompts
            if len(done) == len(tasks):
                outs = [t.result() for t in tasks]
                for out in outs:
                    if out.error:  # the engine failed this request (a step error)
                        raise APIError(f"the engine failed the request: {out.error}", status=500)
                return outs
            if await raw.is_disconnected():
                raise asyncio.CancelledError
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
