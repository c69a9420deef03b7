"""What every HTTP handler of one server shares."""

import dataclasses
from dataclasses import dataclass, field

from runtime.engine.request import SamplingParams
from runtime.online.dp_dispatcher import DPDispatcher
from runtime.online.generation import Generation
from runtime.online.metrics import ServerMetrics
from runtime.online.protocol import APIError
from runtime.online.worker_manager import WorkerManager


@dataclass
class ServerContext:
    dispatcher: DPDispatcher
    manager: WorkerManager
    metrics: ServerMetrics
    tokenizer: object
    model_name: str
    max_model_len: int
    max_in_flight: int  # running batch + queue; beyond it requests get 429
    api_key: str | None = None
    served_names: tuple[str, ...] = field(default=())
    pd_role: str = "none"  # "prefill" | "decode": one half of a disaggregated deployment
    accepting: bool = True

    def healthy(self) -> bool:
        return self.accepting and self.dispatcher.failure is None and self.manager.alive()

    def check_model(self, name: str) -> None:
        if name not in (self.model_name, *self.served_names):
            raise APIError(
                404,
                f"the model `{name}` does not exist; this server serves `{self.model_name}`",
                "model",
                "not_found_error",
            )

    def output_budget(
        self, prompt_len: int, requested: int | None, default: int | None, param: str, prompt_param: str
    ) -> int:
        """max_tokens for a prompt: as requested (checked against the context length) or the default."""
        room = self.max_model_len - prompt_len
        if requested is not None and requested > room:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens, but the "
                f"prompt has {prompt_len} tokens and {param} asks for {requested} more "
                f"({prompt_len + requested} in all); shorten the prompt or lower {param}",
                param,
            )
        if room < 1:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens and the "
                f"prompt alone has {prompt_len}; shorten the prompt",
                prompt_param,
            )
        return requested or min(room, default or room)

    def admit(self, n: int) -> None:
        """Room for n more requests, or the HTTP error that says why not."""
        if not self.healthy():
            reason = self.dispatcher.failure or "the engine workers are not running"
            raise APIError(503, f"the engine cannot serve requests now: {reason}", kind="server_error")
        if self.dispatcher.in_flight + n > self.max_in_flight:
            raise APIError(
                429,
                f"the server is full ({self.dispatcher.in_flight} requests in flight, at most "
                f"{self.max_in_flight}); retry later",
                kind="rate_limit_error",
            )

    def generation(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        stop_strings: list[str],
        bootstrap_room: int | None,
        bootstrap_url: str | None = None,
    ) -> Generation:
        """The request as this server's role runs it: a prefill instance computes the first token only."""
        if self.pd_role == "none":
            bootstrap_room = None
        elif bootstrap_room is None:
            raise APIError(
                400,
                f"this is the {self.pd_role} instance of a disaggregated deployment; send "
                "requests to its router",
                "bootstrap_room",
            )
        if self.pd_role == "prefill":
            sampling = dataclasses.replace(sampling, max_new_tokens=1, ignore_eos=True, stop_token_ids=())
            stop_strings = []
        return Generation(
            self.dispatcher,
            self.metrics,
            self.tokenizer,
            prompt_token_ids,
            sampling,
            stop_strings,
            bootstrap_room,
            bootstrap_url,
        )
