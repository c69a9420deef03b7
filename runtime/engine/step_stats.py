"""Per-phase step times (prefill / decode), kept by the engine and by the standalone runner alike."""

from dataclasses import dataclass, field


@dataclass
class PhaseTimes:
    """Step times of one phase in constant memory: count, sum and the first (cold) step."""

    count: int = 0
    total_ms: float = 0.0
    first_ms: float = 0.0

    def add(self, ms: float) -> None:
        if not self.count:
            self.first_ms = ms
        self.count, self.total_ms = self.count + 1, self.total_ms + ms

    def mean(self, skip_first: bool = False) -> float:
        if skip_first and self.count > 1:
            return (self.total_ms - self.first_ms) / (self.count - 1)
        return self.total_ms / self.count if self.count else 0.0


@dataclass
class StepStats:
    prefill: PhaseTimes = field(default_factory=PhaseTimes)
    decode: PhaseTimes = field(default_factory=PhaseTimes)

    def record(self, is_prefill: bool, ms: float) -> None:
        (self.prefill if is_prefill else self.decode).add(ms)
