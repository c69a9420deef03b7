"""The bench's workloads: fixed seeds, `ignore_eos`, token-id prompts (no tokenizer in the timed path)."""

import random
from dataclasses import dataclass

WORKLOADS = ("decode1", "mixed64", "prefill")


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_lens: list[int]
    output_lens: list[int]
    peer_batch: int  # transformers runs left-padded batches of this many requests, in arrival order

    @property
    def num_requests(self) -> int:
        return len(self.prompt_lens)

    @property
    def max_len(self) -> int:
        return max(p + o for p, o in zip(self.prompt_lens, self.output_lens))

    def prompts(self, vocab_size: int, seed: int = 0) -> list[list[int]]:
        rng = random.Random(seed)
        hi = min(vocab_size, 32000) - 1
        return [[rng.randint(1, hi) for _ in range(n)] for n in self.prompt_lens]


def make_workload(name: str, quick: bool = False) -> Workload:
    """The issue's sizes, or tiny ones (`quick`) that only exercise the code."""
    if name == "decode1":
        return Workload(name, [8 if quick else 16], [8 if quick else 128], peer_batch=1)
    if name == "prefill":
        n, length = (2, 32) if quick else (8, 512)
        return Workload(name, [length] * n, [1] * n, peer_batch=n)
    if name == "mixed64":
        n, (lo_p, hi_p), (lo_o, hi_o) = (8, (4, 32), (2, 8)) if quick else (64, (16, 512), (32, 256))
        rng = random.Random(0)
        prompts = [rng.randint(lo_p, hi_p) for _ in range(n)]
        outputs = [rng.randint(lo_o, hi_o) for _ in range(n)]
        return Workload(name, prompts, outputs, peer_batch=8)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
