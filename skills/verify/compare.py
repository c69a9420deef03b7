"""Compare the migrated model's greedy run with transformers': tokens exactly, log-probabilities within a
tolerance that fits the dtype."""

from dataclasses import asdict, dataclass, field

from skills.verify.reference import Reference

# |log p(migrated) - log p(transformers)| allowed on the tokens the migrated run ranked highest
LOGPROB_ATOL = {"float32": 2e-3, "float16": 0.05, "bfloat16": 0.25, "float64": 1e-6}
# ... when the checkpoint quantizes activations per token (W8A8): float sums taken in another order than
# transformers' move an element across a rounding tie now and then, and that element then differs by a whole
# quantization step (max |x| / 127.5 for int8), which no float tolerance of the dtype covers
ACTIVATION_QUANT_LOGPROB_ATOL = 0.25


@dataclass(frozen=True)
class Difference:
    prompt_index: int
    prompt: str
    position: int  # index of the generated token, 0 = the prefill's token
    migrated_token: int | None  # None: the migrated run stopped before this position
    transformers_token: int
    migrated_text: str
    transformers_text: str


@dataclass
class Verification:
    status: str  # "identical" | "near_tie" | "mismatch" | "skipped"
    reference: str = ""  # e.g. "transformers 4.57.1 LlamaForCausalLM"
    dtype: str = ""
    world_size: int = 1
    yaml: str = ""
    prompts: list[str] = field(default_factory=list)
    tokens_per_prompt: int = 0
    tokens_compared: int = 0
    max_logprob_diff: float | None = None
    logprob_atol: float | None = None
    first_difference: Difference | None = None
    # activation-quantized checkpoints: prompts that parted where transformers' own top two were within the
    # tolerance (each prompt is compared up to there)
    near_ties: list[Difference] = field(default_factory=list)
    reason: str = ""  # why a check was skipped, or why logits alone failed it
    checked_at: str = ""

    @property
    def identical(self) -> bool:
        return self.status == "identical"

    def to_dict(self) -> dict:
        return {"identical": self.identical, **asdict(self)}


def logprob_atol(dtype: str, quantized_activations: bool = False) -> float:
    return max(LOGPROB_ATOL[dtype], ACTIVATION_QUANT_LOGPROB_ATOL if quantized_activations else 0.0)


def compare(
    outputs: list[dict],
    references: list[Reference],
    dtype: str,
    decode,
    atol: float,
    allow_near_ties: bool = False,
) -> dict:
    """Fields of a Verification for `skill run --json --logprobs K` outputs against the references, each up
    to (and including) the first differing token; decode(ids) -> text. ``allow_near_ties``: a prompt whose
    tokens part where transformers rates ours within `atol` of its own pick is a near tie, not a mismatch."""
    compared, worst, first, ties = 0, 0.0, None, []
    for i, (out, ref) in enumerate(zip(outputs, references, strict=True)):
        for pos, theirs in enumerate(ref.tokens):
            ours = out["token_ids"][pos] if pos < len(out["token_ids"]) else None
            compared += 1
            for token, logprob in out["logprobs"][pos]["top"] if ours is not None else []:
                worst = max(worst, abs(logprob - float(ref.logprobs[pos, token])))
            if ours != theirs:
                text = decode([ours]) if ours is not None else "(stopped)"
                difference = Difference(i, out["prompt"], pos, ours, theirs, text, decode([theirs]))
                tied = ours is not None and float(ref.logprobs[pos, theirs] - ref.logprobs[pos, ours]) <= atol
                if allow_near_ties and tied:
                    ties.append(difference)
                else:
                    first = difference
                break
        if first:
            break
    fields = {
        "tokens_compared": compared,
        "max_logprob_diff": worst,
        "logprob_atol": atol,
        "first_difference": first,
        "near_ties": ties,
    }
    if first:
        return {**fields, "status": "mismatch"}
    if worst > atol:
        return {
            **fields,
            "status": "mismatch",
            "reason": f"greedy tokens are identical but log-probabilities differ by up to {worst:.3g} "
            f"(tolerance {atol:g} in {dtype}{' with activations quantized' if atol > LOGPROB_ATOL[dtype] else ''})",
        }
    return {**fields, "status": "near_tie" if ties else "identical"}
