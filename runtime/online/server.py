"""`skill serve`: FastAPI + uvicorn in the parent process, engine workers behind a DPDispatcher."""

import asyncio
import contextlib
import hmac
import logging
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from transformers import AutoTokenizer

from runtime.config import DisaggConfig, InferenceConfig
from runtime.errors import UserError
from runtime.kv_cache.sizing import cdiv
from runtime.launch import SINGLE_NODE, NodeLayout
from runtime.online.context import ServerContext
from runtime.online.disagg.transfer_engine import BACKENDS, make_transfer_engine
from runtime.online.dp_dispatcher import DPDispatcher, WorkerError
from runtime.online.metrics import ServerMetrics
from runtime.online.openai_api import router
from runtime.online.protocol import APIError
from runtime.online.serving_config import serving_config
from runtime.online.worker_manager import WorkerManager

logger = logging.getLogger(__name__)
HEALTH_POLL_S = 0.5


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_model_len: int | None = None
    max_queue: int = 256
    served_model_name: str | None = None
    grace_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    startup_timeout_s: float = 900.0
    nodes: NodeLayout = SINGLE_NODE
    pd_role: str = "none"  # "prefill" | "decode" (the router is runtime.online.router)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)

    @property
    def worker_disagg(self) -> DisaggConfig | None:
        """What the engine workers are told about disaggregation (nothing in a combined server)."""
        return self.disagg if self.pd_role != "none" else None


def _require_api_key(request: Request) -> None:
    key = request.app.state.ctx.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise APIError(
            401, "missing or wrong API key; send `Authorization: Bearer <key>`", kind="authentication_error"
        )


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        return APIError(
            400, f"the request body is not valid JSON ({err.get('ctx', {}).get('error', err['msg'])})", "body"
        ).response()
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or "body"
    return APIError(400, f"`{param}`: {err['msg']}", param).response()


def build_app(ctx: ServerContext) -> FastAPI:
    app = FastAPI(title="model-infer-skills", docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    app.add_exception_handler(APIError, lambda request, exc: exc.response())
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(
        HTTPException, lambda request, exc: APIError(exc.status_code, str(exc.detail)).response()
    )
    app.include_router(router, dependencies=[Depends(_require_api_key)])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if ctx.healthy() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        ctx.metrics.set_engine(ctx.dispatcher.stats)
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    if ctx.pd_role == "prefill":

        @app.get("/bootstrap/rank_table")
        async def rank_table() -> dict:
            """Where decode leaders fetch KV: the KV endpoint of each DP leader (bootstrap_room % dp_size)."""
            return {"leaders": ctx.dispatcher.kv_addresses}

    @app.get("/v1/models", dependencies=[Depends(_require_api_key)])
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "model-infer-skills",
                    "max_model_len": ctx.max_model_len,
                }
                for name in (ctx.model_name, *ctx.served_names)
            ],
        }

    return app


def ignore_reraised_signals() -> None:
    """uvicorn re-raises the SIGTERM / SIGINT that stopped it once it has shut down; that is a clean exit here."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)


def _listen(host: str, port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); pick another port or host") from None
    return s


def _bind_ports(settings: ServeSettings) -> list[socket.socket]:
    """Held from the start: a port chosen free could otherwise be taken (by a worker's ephemeral port, say) while
    the workers start."""
    bootstrap = (settings.disagg.bootstrap_host, settings.disagg.bootstrap_port)
    if settings.pd_role == "prefill" and bootstrap == (settings.host, settings.port):
        raise UserError(
            f"--bootstrap-port {settings.port} is the server's own --port; give them different ports"
        )
    sockets = [_listen(settings.host, settings.port)]
    if settings.pd_role == "prefill":  # the bootstrap endpoint: same app, its own port
        try:
            sockets.append(_listen(*bootstrap))
        except BaseException:
            sockets[0].close()
            raise
    return sockets


async def _watch_workers(ctx: ServerContext) -> None:
    while ctx.manager.alive():
        await asyncio.sleep(HEALTH_POLL_S)
    ctx.dispatcher.fail(f"the engine workers exited (code {ctx.manager.proc.returncode})")


async def _serve(
    config: InferenceConfig, settings: ServeSettings, manager: WorkerManager, sockets: list[socket.socket]
) -> None:
    limit = config.max_seq_len  # serving_config made it --max-model-len when given
    tokenizer = AutoTokenizer.from_pretrained(
        config.model_config.model_path, trust_remote_code=config.model_config.trust_remote_code
    )
    nodes = settings.nodes
    dispatcher = DPDispatcher(
        config.parallel_config.attn_dp_size, nodes.master_addr if nodes.nnodes > 1 else "127.0.0.1"
    )
    name = settings.served_model_name or config.model_name
    ctx = ServerContext(
        dispatcher,
        manager,
        ServerMetrics(name),
        tokenizer,
        name,
        limit,
        config.scheduler_config.batch_size + settings.max_queue,
        settings.api_key,
        ("default",) if name != "default" else (),
        settings.pd_role,
    )
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)  # until uvicorn takes over
    manager.start(dispatcher.addresses)
    try:
        try:
            await dispatcher.wait_ready(manager.alive, settings.startup_timeout_s)
        except WorkerError as e:
            raise UserError(f"the engine did not start: {e}; see the worker log above") from None
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
        ignore_reraised_signals()
        smallest = min(s.kv_total_blocks for s in dispatcher.stats)
        if dispatcher.block_size and cdiv(limit, dispatcher.block_size) > smallest:
            raise UserError(
                f"the KV cache holds {smallest} blocks of {dispatcher.block_size} tokens, fewer than "
                f"one request of --max-model-len {limit} needs; lower --max-model-len or raise "
                "scheduler_config.num_kv_blocks / mem_fraction_static"
            )
        watcher = asyncio.create_task(_watch_workers(ctx))
        server = uvicorn.Server(
            uvicorn.Config(build_app(ctx), timeout_graceful_shutdown=settings.grace_s, log_level="info")
        )
        logger.info(
            "serving %s on http://%s:%d/v1 (max model length %d%s)",
            name,
            settings.host,
            settings.port,
            limit,
            f", {settings.pd_role} instance" if settings.pd_role != "none" else "",
        )
        await server.serve(sockets=sockets)
        watcher.cancel()
    except asyncio.CancelledError:
        logger.info("stopped before the server started")
    finally:
        ctx.accepting = False
        with contextlib.suppress(Exception):
            dispatcher.shutdown()
        manager.stop(settings.grace_s)
        dispatcher.close()


def _worker_manager(
    model_dir: Path,
    yaml_path: Path,
    config: InferenceConfig,
    settings: ServeSettings,
    held: Sequence[socket.socket] = (),
) -> WorkerManager:
    return WorkerManager(
        model_dir,
        yaml_path,
        config.world_size,
        settings.max_model_len,
        settings.nodes,
        settings.worker_disagg,
        held,
    )


def run_worker_node(model_dir: Path, yaml_path: Path, settings: ServeSettings) -> None:
    """Node k > 0 of a multi-node server: this node's engine workers only; node 0 serves HTTP."""
    config = serving_config(yaml_path, settings.max_model_len)
    settings.nodes.check(config.world_size)
    manager = _worker_manager(model_dir, yaml_path, config, settings)
    stop = {"requested": False}

    def on_signal(*_) -> None:
        stop["requested"] = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    manager.start(None)
    while manager.alive() and not stop["requested"]:
        time.sleep(HEALTH_POLL_S)
    code = manager.stop(settings.grace_s)
    if code and not stop["requested"]:
        raise UserError(f"the engine workers of node {settings.nodes.node_rank} exited with code {code}")


def run_server(model_dir: Path, yaml_path: Path, settings: ServeSettings) -> None:
    if settings.nodes.node_rank > 0:
        return run_worker_node(model_dir, yaml_path, settings)
    config = serving_config(
        yaml_path, settings.max_model_len
    )  # a bad YAML fails here, before any process starts
    settings.nodes.check(config.world_size)
    if settings.pd_role != "none" and settings.disagg.engine_backend not in BACKENDS:
        make_transfer_engine(settings.disagg.engine_backend, settings.pd_role, "", 0)  # raises the UserError
    sockets = _bind_ports(settings)
    try:
        manager = _worker_manager(model_dir, yaml_path, config, settings, sockets)
        try:
            asyncio.run(_serve(config, settings, manager, sockets))
        finally:
            manager.stop(settings.grace_s)  # a launcher not started yet (the server stopped first) leaves
    finally:
        for s in sockets:
            s.close()
