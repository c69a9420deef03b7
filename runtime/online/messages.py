"""What the server's parent process and the DP-leader workers send each other over ZMQ (pickled)."""

from dataclasses import dataclass

from runtime.engine.request import SamplingParams, StepOutput


@dataclass(frozen=True)
class WorkerAddresses:
    """ZMQ endpoints the parent binds: one request queue per DP leader, one shared result queue."""

    requests: list[str]
    results: str


# parent -> DP leader
@dataclass(frozen=True)
class AddRequest:
    rid: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    bootstrap_room: int | None = None  # prefill-decode disaggregation: pairs the two halves of a request
    bootstrap_url: str | None = None  # where the decode side finds the prefill instance's rank table


@dataclass(frozen=True)
class AbortRequest:
    rid: int


@dataclass(frozen=True)
class Shutdown:
    pass


# DP leader -> parent
@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_used_blocks: int
    kv_total_blocks: int


@dataclass(frozen=True)
class WorkerReady:
    dp_rank: int
    stats: EngineStats
    block_size: int
    kv_address: str | None = None  # a prefill leader's KV transfer endpoint


@dataclass(frozen=True)
class StepResult:
    dp_rank: int
    outputs: list[StepOutput]  # request_id is the parent's rid
    stats: EngineStats


@dataclass(frozen=True)
class WorkerFailed:
    dp_rank: int
    error: str
