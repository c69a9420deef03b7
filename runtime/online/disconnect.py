"""Waiting on behalf of an HTTP client that may go away (uvicorn cancels nothing for a non-streamed request)."""

import asyncio
from collections.abc import Awaitable

from starlette.requests import Request

POLL_S = 0.25


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def unless_disconnected(request: Request, awaitable: Awaitable):
    """The awaitable's result; if the client disconnects first, it is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        task.cancel()
