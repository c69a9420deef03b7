"""The PD router (`skill serve --pd-role router`): gives each request a bootstrap_room, sends it to prefill
instance room % P (for the KV and first token) and decode instance room % D at once, and answers with the
decode instance's response, streamed when asked. The prefill's answer is awaited first: its error (a bad
request, a full queue) is the client's answer, and the decode half is dropped. A backend that cannot be
reached gives 503."""

import asyncio
import contextlib
import json
import logging
import secrets
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from runtime.online.disconnect import ClientGone, unless_disconnected
from runtime.online.protocol import APIError
from runtime.online.server import ignore_reraised_signals

logger = logging.getLogger(__name__)
ROUTED = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class RouterSettings:
    prefill: list[str]  # base URLs, e.g. http://127.0.0.1:8100
    decode: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    timeout_s: float = 600.0


def _unreachable(role: str, url: str, error: Exception) -> APIError:
    return APIError(
        503, f"the {role} instance at {url} failed: {type(error).__name__}: {error}", kind="server_error"
    )


def _passthrough(r: httpx.Response) -> Response:
    return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))


async def _drop(call: asyncio.Future) -> None:
    """Cancel a backend call, closing its connection if it was open (the backend then aborts the request)."""
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await (await call).aclose()


def build_router(settings: RouterSettings) -> FastAPI:
    app = FastAPI(title="model-infer-skills PD router", docs_url=None, redoc_url=None)
    timeout = httpx.Timeout(settings.timeout_s, connect=5.0)
    # no connection is reused: a request sent on one the backend's uvicorn is closing fails with ReadError, which
    # expiring idle connections first (2 s against uvicorn's 5 s) still let through under the suite's load; a
    # connection per request costs a local connect, nothing beside a prefill
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    # one pool per side: decode streams waiting for their KV must not hold the connections prefills need
    prefills, decodes = (httpx.AsyncClient(timeout=timeout, limits=limits) for _ in range(2))
    app.add_exception_handler(APIError, lambda request, exc: exc.response())

    async def route(request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "the request body is not valid JSON", "body") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", "body")
        room = secrets.randbits(62)
        prefill = settings.prefill[room % len(settings.prefill)]
        decode = settings.decode[room % len(settings.decode)]
        body["bootstrap_room"], body["bootstrap_url"] = room, prefill  # it serves the rank table too
        headers = {k: v for k, v in request.headers.items() if k == "authorization"}
        first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        outgoing = decodes.build_request("POST", decode + path, json=body, headers=headers)
        decode_call = asyncio.ensure_future(decodes.send(outgoing, stream=bool(body.get("stream"))))
        try:
            p = await unless_disconnected(request, prefills.post(prefill + path, json=first, headers=headers))
        except httpx.HTTPError as e:
            p = _unreachable("prefill", prefill, e)
        except ClientGone:
            p = None
        if p is None or isinstance(p, APIError) or p.status_code != 200:
            await _drop(decode_call)
            return (
                Response(status_code=499)
                if p is None
                else p.response()
                if isinstance(p, APIError)
                else _passthrough(p)
            )
        try:
            stream = await unless_disconnected(request, decode_call)
        except httpx.HTTPError as e:
            raise _unreachable("decode", decode, e) from None
        except ClientGone:  # the decode side sees its connection closed and aborts the request
            return Response(status_code=499)
        if not body.get("stream"):
            return _passthrough(stream)
        if stream.status_code != 200:
            await stream.aread()
            await stream.aclose()
            return _passthrough(stream)

        async def relay():
            try:
                async for chunk in stream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                error = {
                    "message": _unreachable("decode", decode, e).message,
                    "type": "server_error",
                    "code": 503,
                }
                yield f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n"
            finally:
                await stream.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    def endpoint(path: str):
        async def handler(request: Request) -> Response:
            return await route(request, path)

        return handler

    for path in ROUTED:
        app.add_api_route(path, endpoint(path), methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        async def ok(url: str) -> bool:
            try:
                return (await decodes.get(f"{url}/health", timeout=5)).status_code == 200
            except httpx.HTTPError:
                return False

        results = await asyncio.gather(*(ok(u) for u in settings.prefill + settings.decode))
        return Response(status_code=200 if all(results) else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k == "authorization"}
        try:
            return _passthrough(await decodes.get(f"{settings.decode[0]}/v1/models", headers=headers))
        except httpx.HTTPError as e:
            raise _unreachable("decode", settings.decode[0], e) from None

    return app


def run_router(settings: RouterSettings) -> None:
    logger.info(
        "routing http://%s:%d/v1 to prefill %s and decode %s",
        settings.host,
        settings.port,
        settings.prefill,
        settings.decode,
    )
    ignore_reraised_signals()
    uvicorn.run(build_router(settings), host=settings.host, port=settings.port, log_level="info")
