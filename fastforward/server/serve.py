"""``fastforward serve``: load the model, start the engine thread, run uvicorn."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastforward.engine import EngineArgs, LLMEngine
from fastforward.server.app import ServerConfig, build_app
from fastforward.server.async_engine import AsyncEngine


@dataclass(slots=True)
class ServeArgs:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_waiting: int = 256
    max_body_bytes: int = 4 << 20
    log_level: str = "info"


def serve(engine_args: EngineArgs, args: ServeArgs) -> None:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine = AsyncEngine(LLMEngine(engine_args), max_waiting=args.max_waiting)
    config = ServerConfig(
        served_model_name=args.served_model_name or engine_args.model,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
    )
    app = build_app(engine, config)
    engine.start()
    print(
        f"fastforward serving {config.served_model_name} at http://{args.host}:{args.port} "
        f"(playground: http://{args.host}:{args.port}/ , API: http://{args.host}:{args.port}/v1)",
        flush=True,
    )
    try:
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
        )
    finally:
        engine.shutdown()
