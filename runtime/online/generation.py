"""One prompt's request on the engine workers, as an async stream of text deltas (stop strings applied,
latency metrics recorded). `close()` aborts it if it has not finished: call it when the client goes away."""

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from runtime.engine.request import SamplingParams, StepOutput, TokenLogprob
from runtime.online.detokenizer import IncrementalDetokenizer
from runtime.online.dp_dispatcher import DPDispatcher, WorkerError
from runtime.online.metrics import ServerMetrics

KV_TRANSFER_FAILED = (
    "the request's KV did not arrive from the prefill instance in time, or did not fit this "
    "decode instance (its log says which)"
)


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None


@dataclass
class Completion:
    """A whole generation, for a non-streamed answer."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class Generation:
    def __init__(
        self,
        dispatcher: DPDispatcher,
        metrics: ServerMetrics,
        tokenizer,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        stop_strings: list[str],
        bootstrap_room: int | None = None,
        bootstrap_url: str | None = None,
    ):
        self.dispatcher, self.metrics = dispatcher, metrics
        self.prompt_token_ids, self.sampling = prompt_token_ids, sampling
        self.bootstrap = bootstrap_room, bootstrap_url
        self.detok = IncrementalDetokenizer(tokenizer, stop_strings)
        self.rid: int | None = None
        self.finished = False
        self.num_output_tokens = 0
        dispatcher.reserve()

    async def deltas(self) -> AsyncIterator[Delta]:
        last = time.perf_counter()  # arrival: the first gap is the time to first token
        try:
            self.rid, queue = self.dispatcher.submit(self.prompt_token_ids, self.sampling, *self.bootstrap)
        except WorkerError:
            self.finished = True
            raise
        self.metrics.prompt_tokens.inc(len(self.prompt_token_ids))
        while not self.finished:
            out: StepOutput | WorkerError = await queue.get()
            if isinstance(out, WorkerError) or out.finish_reason == "error":
                self.finished = True
                self.metrics.finished("error")
                raise out if isinstance(out, WorkerError) else WorkerError(KV_TRANSFER_FAILED)
            now = time.perf_counter()
            (self.metrics.tpot if self.num_output_tokens else self.metrics.ttft).observe(now - last)
            last = now
            self.num_output_tokens += len(out.new_token_ids)
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
            text = self.detok.add(out.new_token_ids)
            reason = "stop" if self.detok.stopped else out.finish_reason if out.finished else None
            if reason:
                self.finished = True
                text += self.detok.flush()
                self.metrics.finished(reason)
                if not out.finished:
                    self.dispatcher.abort(self.rid)  # a stop string ended it before the engine did
            yield Delta(text, out.new_token_ids, out.logprobs or [], reason)

    async def collect(self) -> Completion:
        done = Completion()
        async for d in self.deltas():
            done.text += d.text
            done.token_ids += d.token_ids
            done.logprobs += d.logprobs
            done.finish_reason = d.finish_reason
        return done

    def close(self) -> None:
        if self.rid is None and not self.finished:
            self.finished = True
            self.dispatcher.release()
        elif not self.finished:
            self.finished = True
            self.metrics.finished("abort")
            self.dispatcher.abort(self.rid)

    def __del__(self):
        if self.rid is None and not self.finished:  # a stream dropped before it started
            self.dispatcher.release()
