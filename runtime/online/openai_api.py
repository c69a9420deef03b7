"""/v1/completions and /v1/chat/completions: OpenAI's request and response shapes over Generation."""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError

from runtime.engine.request import SamplingParams, TokenLogprob
from runtime.online.context import ServerContext
from runtime.online.disconnect import ClientGone, unless_disconnected
from runtime.online.dp_dispatcher import WorkerError
from runtime.online.generation import Completion, Generation
from runtime.online.protocol import APIError, ChatCompletionRequest, CompletionRequest, _GenerationRequest

router = APIRouter()
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left


def _sampling(body: _GenerationRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        temperature=body.temperature,
        top_k=max(body.top_k, 0),
        top_p=body.top_p,
        seed=body.seed,
        max_new_tokens=max_tokens,
        stop_token_ids=body.all_stop_token_ids(),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )


def _usage(gens: list[Generation]) -> dict:
    prompt = sum(len(g.prompt_token_ids) for g in gens)
    done = sum(g.num_output_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _token_text(ctx: ServerContext, token_id: int) -> str:
    """A token as text; a piece of a multi-byte character as its vocabulary entry (so tokens stay distinct)."""
    text = ctx.tokenizer.decode([token_id])
    return ctx.tokenizer.convert_ids_to_tokens(token_id) if "\ufffd" in text else text


def _completion_logprobs(ctx: ServerContext, lps: list[TokenLogprob], offset: int) -> dict:
    tokens = [_token_text(ctx, lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{_token_text(ctx, t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def _chat_logprobs(ctx: ServerContext, lps: list[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = _token_text(ctx, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
        ]
    }


async def _collect(request: Request, gens: list[Generation]) -> list[Completion] | None:
    """Every generation's result, or None when the client went away (its requests are aborted)."""
    try:
        return await unless_disconnected(request, asyncio.gather(*(g.collect() for g in gens)))
    except ClientGone:
        return None
    except WorkerError as e:
        raise APIError(503, f"the engine cannot serve requests now: {e}", kind="server_error") from None
    finally:
        for g in gens:
            g.close()


def _with_ids(body: _GenerationRequest, choice: dict, token_ids: list[int]) -> dict:
    return {**choice, "token_ids": token_ids} if body.return_token_ids else choice


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream(
    gens: list[Generation], chunk, include_usage: bool, first: list[dict] = ()
) -> AsyncIterator[str]:
    """Server-sent events of every generation's deltas (merged as they come), usage, then [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, gen: Generation) -> None:
        try:
            async for delta in gen.deltas():
                await queue.put((index, delta))
        except WorkerError as e:
            await queue.put((index, e))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        for payload in first:
            yield _sse(payload)
        open_ = len(gens)
        while open_:
            index, item = await queue.get()
            if item is None:
                open_ -= 1
            elif isinstance(item, WorkerError):
                yield _sse(
                    {
                        "error": {
                            "message": f"the engine cannot serve requests now: {item}",
                            "type": "server_error",
                            "param": None,
                            "code": 503,
                        }
                    }
                )
            elif payload := chunk(index, item):
                yield _sse(payload)
        if include_usage:
            yield _sse({**chunk(None, None), "choices": [], "usage": _usage(gens)})
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            g.close()


def _header(kind: str, model: str, rid: str) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    ctx.check_model(body.model)
    vocab = len(ctx.tokenizer)
    requests = []
    for p in body.prompts():
        ids = ctx.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
        budget = ctx.output_budget(
            len(ids), body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens", "prompt"
        )
        requests.append((ids, _sampling(body, budget, body.logprobs)))
    ctx.admit(len(requests))
    room = body.bootstrap_room
    gens = [
        ctx.generation(
            ids,
            sampling,
            body.stop_strings(),
            None if room is None else room + i,  # a room each
            body.bootstrap_url,
        )
        for i, (ids, sampling) in enumerate(requests)
    ]
    rid, model = f"cmpl-{uuid.uuid4().hex}", body.model
    want_lp = body.logprobs is not None
    if body.stream:
        offsets = [0] * len(gens)

        def chunk(index, delta):
            head = _header("text_completion", model, rid)
            if delta is None:
                return head
            lp = _completion_logprobs(ctx, delta.logprobs, offsets[index]) if want_lp else None
            offsets[index] += len(delta.text)
            choice = {
                "index": index,
                "text": delta.text,
                "logprobs": lp,
                "finish_reason": delta.finish_reason,
            }
            return {**head, "choices": [_with_ids(body, choice, delta.token_ids)]}

        return StreamingResponse(_stream(gens, chunk, body.include_usage), media_type="text/event-stream")
    results = await _collect(request, gens)
    if results is None:
        return Response(status_code=499)
    choices = [
        _with_ids(
            body,
            {
                "index": i,
                "text": r.text,
                "finish_reason": r.finish_reason,
                "logprobs": _completion_logprobs(ctx, r.logprobs, 0) if want_lp else None,
            },
            r.token_ids,
        )
        for i, r in enumerate(results)
    ]
    return JSONResponse({**_header("text_completion", model, rid), "choices": choices, "usage": _usage(gens)})


def _chat_prompt(ctx: ServerContext, body: ChatCompletionRequest) -> list[int]:
    if not ctx.tokenizer.chat_template:
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", "messages")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    try:
        return list(
            ctx.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                **body.chat_template_kwargs,
            )
        )
    except (TemplateError, TypeError, ValueError) as e:
        raise APIError(400, f"the chat template rejected these messages: {e}", "messages") from None


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    ctx.check_model(body.model)
    ids = _chat_prompt(ctx, body)
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    budget = ctx.output_budget(len(ids), body.output_limit, None, param, "messages")
    top = body.top_logprobs or 0 if body.logprobs else None
    sampling = _sampling(body, budget, top)
    ctx.admit(1)
    gen = ctx.generation(ids, sampling, body.stop_strings(), body.bootstrap_room, body.bootstrap_url)
    rid, model = f"chatcmpl-{uuid.uuid4().hex}", body.model
    if body.stream:

        def chunk(index, delta):
            head = _header("chat.completion.chunk", model, rid)
            if delta is None:
                return head
            if (
                not delta.text
                and not delta.finish_reason
                and not delta.logprobs
                and not body.return_token_ids
            ):
                return None
            choice = {
                "index": 0,
                "delta": {"content": delta.text} if delta.text else {},
                "logprobs": _chat_logprobs(ctx, delta.logprobs) if body.logprobs else None,
                "finish_reason": delta.finish_reason,
            }
            return {**head, "choices": [_with_ids(body, choice, delta.token_ids)]}

        first = {
            **_header("chat.completion.chunk", model, rid),
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        return StreamingResponse(
            _stream([gen], chunk, body.include_usage, [first]), media_type="text/event-stream"
        )
    results = await _collect(request, [gen])
    if results is None:
        return Response(status_code=499)
    r = results[0]
    choice = _with_ids(
        body,
        {
            "index": 0,
            "message": {"role": "assistant", "content": r.text},
            "finish_reason": r.finish_reason,
            "logprobs": _chat_logprobs(ctx, r.logprobs) if body.logprobs else None,
        },
        r.token_ids,
    )
    return JSONResponse(
        {**_header("chat.completion", model, rid), "choices": [choice], "usage": _usage([gen])}
    )
