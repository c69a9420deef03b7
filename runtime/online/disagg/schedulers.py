"""The prefill instance's scheduler: a finished request keeps its KV blocks until they are staged for transfer."""

from runtime.engine.request import Request
from runtime.engine.scheduler import Scheduler


class PrefillDisaggScheduler(Scheduler):
    holds_finished = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.held: list[Request] = []

    def release_finished(self, request: Request) -> None:
        self.held.append(request)

    def take_held(self) -> list[Request]:
        """Finished requests whose blocks are still allocated; the caller copies them out, then frees them."""
        held, self.held = self.held, []
        return held
