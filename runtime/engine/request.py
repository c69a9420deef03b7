"""Requests, sampling parameters and the batch of one scheduler step."""

import itertools
from dataclasses import dataclass, field
from enum import Enum

_ids = itertools.count()


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k = the sampled token's log-probability and the k most likely

    def __post_init__(self):
        if (
            self.temperature < 0
            or not 0 < self.top_p <= 1
            or self.top_k < 0
            or self.max_new_tokens < 1
            or (self.logprobs is not None and self.logprobs < 0)
        ):
            raise ValueError(f"invalid sampling parameters: {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt: str = ""
    request_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    computed_len: int = 0  # tokens whose KV is in the cache
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a sampled token under the model's raw distribution, and the most likely tokens."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class StepOutput:
    """What one engine step produced for one request: enough to stream it."""

    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (PD: KV lost) once finished
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them


@dataclass
class Batch:
    """The requests of one step: a prefill of whole sequences or one decode token each."""

    requests: list[Request]
    is_prefill: bool

    def __len__(self) -> int:
        return len(self.requests)

    def new_token_ids(self) -> list[list[int]]:
        """Tokens to feed this step per request (prefill recomputes after a preemption)."""
        if self.is_prefill:
            return [r.all_token_ids for r in self.requests]
        return [[r.output_token_ids[-1]] for r in self.requests]

    def update_requests_from_batch(self, next_tokens: list[int]) -> None:
        for r, tok in zip(self.requests, next_tokens, strict=True):
            r.computed_len = r.num_tokens
            r.output_token_ids.append(tok)
