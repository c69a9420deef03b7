"""Where a verification result goes: `verification` in agentic/baseline/baseline_metadata.json and the
"## Verified" section of the model README (the only place either states parity)."""

import json
import re
from pathlib import Path

from skills.atomic_write import write_text_atomic
from skills.verify.compare import LOGPROB_ATOL, Verification

METADATA = Path("agentic") / "baseline" / "baseline_metadata.json"
_SECTION = re.compile(r"^## Verified\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)


def describe(v: Verification) -> str:
    """The README's account of one check, in Markdown."""
    if v.status == "skipped":
        return f"Not verified against transformers: {v.reason}."
    what = (
        f"{len(v.prompts)} prompts x {v.tokens_per_prompt} greedy tokens, {v.dtype}, world_size {v.world_size} "
        f"(`{v.yaml}`), against {v.reference} on the same weights and prompt tokens, by `skill verify` on "
        f"{v.checked_at[:10]}"
    )
    if v.status in ("identical", "near_tie"):
        why = ""
        if v.reason:  # the float32 drift that float64 settled
            why = f"; {v.reason}"
        elif v.logprob_atol > LOGPROB_ATOL[v.dtype]:
            why = (
                ", wider than the dtype's because the checkpoint quantizes activations per token: a float sum "
                "taken in another order can move an element across a rounding tie, a whole quantization step"
            )
        ties = "".join(
            f" Prompt {t.prompt_index} parted at generated token {t.position}, where transformers rates the "
            f"migrated pick {t.migrated_token} ({t.migrated_text!r}) within the tolerance of its own "
            f"{t.transformers_token} ({t.transformers_text!r}); it is compared up to there."
            for t in v.near_ties
        )
        head = "identical to transformers" if v.identical else "identical to transformers up to near ties"
        return (
            f"Greedy tokens {head}: {v.tokens_compared} tokens compared; log-probabilities within "
            f"{v.max_logprob_diff:.2g} (tolerance {v.logprob_atol:.3g}{why}).{ties} {what}."
        )
    d = v.first_difference
    if d is None:
        return f"**Mismatch**: {v.reason}. {what}."
    return (
        f"**Mismatch** on prompt {d.prompt_index} ({d.prompt!r}) at generated token {d.position}: migrated "
        f"{d.migrated_token} ({d.migrated_text!r}), transformers {d.transformers_token} "
        f"({d.transformers_text!r}). {what}."
    )


def record(model_dir: Path, v: Verification) -> None:
    """Merge the result into the baseline metadata (created if absent) and the README's Verified section."""
    metadata = model_dir / METADATA
    data = json.loads(metadata.read_text(encoding="utf-8")) if metadata.is_file() else {}
    data["verification"] = {**data.get("verification", {}), **v.to_dict()}
    write_text_atomic(metadata, json.dumps(data, ensure_ascii=False, indent=2) + "\n")
    readme = model_dir / "README.md"
    if readme.is_file():
        section = f"## Verified\n\n{describe(v)}\n"
        text = readme.read_text(encoding="utf-8")
        text = (
            _SECTION.sub(lambda _: section, text)
            if _SECTION.search(text)
            else f"{text.rstrip()}\n\n{section}"
        )
        write_text_atomic(readme, text)
