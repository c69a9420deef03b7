"""The coverage sweep: every causal-LM type of the installed transformers, migrated from a tiny random
checkpoint and checked against transformers on the same weights.

    .venv/bin/python scripts/catalogue.py                 # all types -> docs/coverage.md + docs/coverage.json
    .venv/bin/python scripts/catalogue.py --only llama phi3   # re-check some; the others keep their rows
    .venv/bin/python scripts/catalogue.py --only phi3 --out /tmp/probe   # a quick probe, docs/ untouched

Writing into docs/ also regenerates the README's architecture list (between its coverage markers).

Per type: out-of-scope architectures are named first (encoder-decoder, masked-LM encoders, multimodal
wrappers, drafters that ignore the token ids, state-space / hybrid layers, a state carried between tokens);
otherwise a tiny config (the config class's own attribute names, through its attribute_map) and a seed whose
greedy steps keep a top-1 margin of 0.01 are built, the model's causality is probed (XLNet's is not), then `skill migrate --no-run` and `skill verify` (greedy tokens and the top-5 log-probabilities of
every step, prefill included, fp32) run in subprocesses. A clean refusal is REFUSED with the migrator's message; a
traceback anywhere is CRASH. Takes about half a minute per type on 2 CPU cores."""

import argparse
import ast
import copy
import dataclasses
import inspect
import json
import os
import re
import subprocess
import tempfile
import textwrap
import time
from datetime import date
from pathlib import Path

import torch
import transformers
from rich.progress import Progress
from skill_process import skill
from tiny_checkpoint import PARITY_PROMPTS, make_tokenizer, pick_seed, set_token_id, tiny_config
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

from skills.atomic_write import write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
STATUSES = ("PASS", "MISMATCH", "REFUSED", "CRASH", "OUT OF SCOPE", "NO FIXTURE")
NEW_TOKENS = 8
TIMEOUT_S = 900
MAX_FIXTURE_PARAMS = 5_000_000  # a tiny llama has 0.2M; beyond this the standard size names did not apply
# Config fields that only state-space / linear-attention / convolution layers have.
STATE_FIELDS = re.compile(
    r"^(ssm_|mamba_|state_size$|d_state$|linear_(num|key|value)_|conv_L_cache$|time_step_)"
)
MODALITY = re.compile(r"vision|audio|image|video|speech|vq_")
NON_ATTENTION_LAYERS = re.compile(r"mamba|linear_attention|conv|ssm|recurrent", re.IGNORECASE)
# What a modeling file keeps from token to token besides keys and values (a convolution's last inputs, a
# recurrence's state), and what any form of softmax attention in it calls.
CARRIED_STATE = re.compile(r"\b(?:update_)?(conv|recurrent|ssm|rnn)_states?\b")
ATTENTION = re.compile(r"softmax|scaled_dot_product_attention|ALL_ATTENTION_FUNCTIONS")
# transformers' cache API for that state, which the runtime serves per request (runtime/layers/request_states.py)
STATE_API = re.compile(r"\.update_(?:conv|recurrent)_state\(")
CAUSALITY_RTOL = 1e-3  # of the largest logit: fp32 rounding alone moves a deep loop's by 2e-3 (hrm_text)


LEGEND = (
    "PASS: `skill migrate` + `skill verify` on a tiny random checkpoint give transformers' greedy tokens "
    f"({len(PARITY_PROMPTS)} prompts x {NEW_TOKENS}) and top-5 log-probabilities within 2e-3 (fp32). "
    "REFUSED: the migrator or runtime named a construct it does not convert. CRASH: a traceback. "
    "NO FIXTURE: transformers could not build a usable tiny model from the config class alone. "
    "OUT OF SCOPE: not a causal decoder-only text model, a model without attention layers (state-space or "
    "recurrent only), or layers that carry a state from token to token outside transformers' cache API. "
    "Hybrids (state-space, convolution or linear-attention layers beside attention, through that API) are "
    "converted: the runtime keeps their states per request; they are counted apart in the summary."
)


@dataclasses.dataclass
class Entry:
    model_type: str
    status: str
    reason: str = ""
    seconds: float = 0.0
    hybrid: bool = False  # layers carry state from token to token beside attention (served per request)


def _reads_token_ids(model_type: str) -> bool:
    """Whether the causal-LM class's forward reads the `input_ids` it takes (a drafter fed another model's hidden
    states and keys / values keeps the parameter and ignores it: Gemma 4's assistants)."""
    forward = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]).forward
    fn = ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0]
    params = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
    loads = (n for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))
    return "input_ids" not in params or any(n.id == "input_ids" for n in loads)


def _source(model_type: str) -> Path:
    return Path(inspect.getsourcefile(getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])))


def carried_state(model_type: str) -> str | None:
    """What the type's layers carry from token to token besides keys and values (state-space, convolution or
    recurrent layers), or None."""
    config = AutoConfig.for_model(model_type)
    fields = sorted(k for k in vars(config) if STATE_FIELDS.search(k))
    layers = sorted(
        {str(t) for t in getattr(config, "layer_types", None) or () if NON_ATTENTION_LAYERS.search(str(t))}
    )
    if fields or layers:
        return f"state-space layers ({', '.join(layers or fields[:3])})"
    source = _source(model_type)
    if states := sorted({f"{m}_state" for m in CARRIED_STATE.findall(source.read_text())}):
        return f"layers carrying a {' / '.join(states)} from token to token ({source.name})"
    return None


def out_of_scope(model_type: str) -> str | None:
    """Why this type is outside what a decoder-only text runtime converts, or None."""
    if not _reads_token_ids(model_type):
        return "not a text model on its own: its forward ignores input_ids (a drafter fed another model's states)"
    config = AutoConfig.for_model(model_type)
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "encoder-only architecture (masked LM; causal only as a BERT-style decoder)"
    towers = sorted(
        k for k, v in vars(config).items() if isinstance(v, PretrainedConfig) and MODALITY.search(k)
    )
    if towers:
        return f"multimodal: the causal LM wraps {', '.join(towers)}"
    # towers the defaults leave unset but the class declares (Gemma 4 builds them from a checkpoint's config)
    declared = sorted(k for k in vars(config) if MODALITY.search(k) and k.endswith("_config"))
    if declared:
        return f"multimodal: the causal LM wraps {', '.join(declared)} (unset in the defaults)"
    # no tower of its own: the model embeds image patches itself (Fuyu's linear patch embedding)
    inputs = sorted(k for k, v in vars(config).items() if MODALITY.search(k) and not isinstance(v, dict))
    if inputs:
        return f"multimodal: the causal LM takes non-text inputs ({', '.join(inputs)})"
    source = _source(model_type)
    text = source.read_text()
    if not ATTENTION.search(text):
        return (
            f"{carried_state(model_type) or 'recurrent layers'} only, no softmax attention in {source.name} "
            "(the runtime serves such layers beside attention)"
        )
    if (state := carried_state(model_type)) and not STATE_API.search(text):
        return (
            f"{state}, kept outside transformers' cache API (`update_conv_state` / `update_recurrent_state`), "
            "which the runtime's per-request states serve"
        )
    return None


def not_causal(checkpoint: Path, prompt_ids: list[int]) -> str | None:
    """Why the fixture is no causal LM (appending tokens changes what it computes at earlier positions:
    XLNet's permutation LM attends both ways), or None. A KV cache keeps earlier positions as they were."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    ids = torch.tensor([prompt_ids])
    keep = ids.shape[1] // 2
    with torch.no_grad():
        whole, prefix = model(ids).logits[0, :keep], model(ids[:, :keep]).logits[0]
    gap = (whole - prefix).abs().max().item()
    if gap <= CAUSALITY_RTOL * whole.abs().max().item():
        return None
    return (
        f"not causal: appending {ids.shape[1] - keep} tokens moves earlier positions' logits by up to "
        f"{gap:.1e}, which no KV cache reproduces"
    )


def _skill(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return skill(*args, env=env, timeout=TIMEOUT_S, cwd=ROOT)


TRACEBACK = re.compile(r"Traceback|❱")  # plain or rich; also inside a run failure verify relays
# where this machine installed transformers: not for the table
INSTALL_PREFIX = re.compile(r"/\S*?/site-packages/")
NOTHING_WRITTEN = "Nothing was written; extend the rules or port these parts by hand."


def _failure(step: str, proc: subprocess.CompletedProcess) -> Entry:
    text = proc.stderr.strip()
    if TRACEBACK.search(text):
        errors = [
            line.strip() for line in text.splitlines() if re.match(r"^\w*(Error|Exception)\b", line.strip())
        ]
        return Entry("", "CRASH", f"{step}: {(errors or ['traceback, no exception line'])[-1][:300]}")
    message = " ".join(INSTALL_PREFIX.sub("", text.split("error:", 1)[-1]).split())
    return Entry("", "REFUSED", f"{step}: {message.removesuffix(NOTHING_WRITTEN).rstrip(' .')[:1200]}")


def check(model_type: str, work: Path) -> Entry:
    """One type, from fixture to verification."""
    ckpt = work / "checkpoint"
    try:
        if reason := out_of_scope(model_type):
            return Entry(model_type, "OUT OF SCOPE", reason)
        config = tiny_config(model_type)
        sized = copy.deepcopy(config)
        set_token_id(
            sized, "pad_token_id", None, 0
        )  # the fixture's tokenizer sets it; a default may exceed the vocab
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(sized).parameters())
        if size > MAX_FIXTURE_PARAMS:
            raise ValueError(
                f"the tiny config still builds {size / 1e6:.0f}M parameters (sizes it names differently)"
            )
        tokenizer = make_tokenizer(ckpt, config.vocab_size)
        prompts_ids = [tokenizer(p)["input_ids"] for p in PARITY_PROMPTS]
        pick_seed(config, ckpt, prompts_ids, NEW_TOKENS)
        if reason := not_causal(ckpt, max(prompts_ids, key=len)):
            return Entry(model_type, "OUT OF SCOPE", reason)
    except Exception as e:  # noqa: BLE001 -- transformers itself cannot build or run a tiny model of it
        return Entry(model_type, "NO FIXTURE", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
    proc = _skill("migrate", str(ckpt), "-o", str(work / "out"), "--no-run", "--json")
    if proc.returncode:
        return dataclasses.replace(_failure("migrate", proc), model_type=model_type)
    model_dir = json.loads(proc.stdout)["model_dir"]
    prompts = work / "prompts.json"
    prompts.write_text(json.dumps(PARITY_PROMPTS))
    proc = _skill("verify", model_dir, "--prompts-file", str(prompts), "--tokens", str(NEW_TOKENS), "--json")
    if proc.returncode not in (0, 4) or not proc.stdout.strip():
        ran = _skill("run", model_dir, "--raw", "--max-new-tokens", "2")  # the run's own error, whole
        return dataclasses.replace(
            _failure(*(("run", ran) if ran.returncode else ("verify", proc))), model_type=model_type
        )
    result = json.loads(proc.stdout)
    if result["status"] == "identical":
        return Entry(
            model_type,
            "PASS",
            f"{result['tokens_compared']} tokens, log-prob gap {result['max_logprob_diff']:.1e}"
            + (f" ({result['reason']})" if result["reason"] else ""),
        )
    first = result.get("first_difference")
    if first is None:  # the tokens agree, the log-probabilities do not
        return Entry(model_type, "MISMATCH", result["reason"])
    return Entry(
        model_type,
        "MISMATCH",
        f"prompt {first.get('prompt_index')} position {first.get('position')}: "
        f"{first.get('migrated_text')!r} vs transformers {first.get('transformers_text')!r}",
    )


def counts(entries: dict[str, Entry]) -> str:
    """`42 PASS, 1 MISMATCH, ...` in STATUSES order, statuses nobody has left out; then those of the state-space
    hybrids among them."""

    def of(group) -> str:
        return ", ".join(f"{n} {s}" for s in STATUSES if (n := sum(e.status == s for e in group)))

    hybrids = [e for e in entries.values() if e.hybrid]
    return of(entries.values()) + (f"; of these, state-space hybrids: {of(hybrids)}" if hybrids else "")


def render(entries: dict[str, Entry]) -> str:
    lines = [
        "# Coverage: every causal-LM type of the installed transformers",
        "",
        (
            f"Written by `scripts/catalogue.py` on {date.today().isoformat()} against transformers "
            f"{transformers.__version__}; {len(entries)} of its {len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} "
            f"causal-LM types checked: {counts(entries)}."
        ),
        "",
        LEGEND,
        "",
        "| type | status | reason |",
        "| --- | --- | --- |",
    ]
    for t in sorted(entries):
        e = entries[t]
        lines.append(f"| `{t}` | {e.status} | {e.reason.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


README_START, README_END = "<!-- coverage:start -->", "<!-- coverage:end -->"


def load(data_file: Path) -> dict[str, Entry]:
    return {e["model_type"]: Entry(**e) for e in json.loads(data_file.read_text())["types"]}


def readme_block(entries: dict[str, Entry], version: str = transformers.__version__) -> str:
    """The README's architecture list, generated from the coverage table (between the coverage markers)."""
    passed = sorted(t for t, e in entries.items() if e.status == "PASS")
    body = (
        f"Of the {len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} causal-LM types of transformers {version}, "
        f"{len(entries)} checked ({counts(entries)}; "
        f"`docs/coverage.md` has the reason for each), these convert with greedy tokens equal to "
        f"transformers on tiny random checkpoints: {', '.join(passed) or 'none yet'}."
    )
    return f"{README_START}\n{textwrap.fill(body, 110)}\n{README_END}"


def update_readme(readme: Path, entries: dict[str, Entry]) -> None:
    text = readme.read_text()
    start, end = text.index(README_START), text.index(README_END) + len(README_END)
    write_text_atomic(readme, text[:start] + readme_block(entries) + text[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", nargs="+", metavar="TYPE", help="check these types (the rest keep their rows)"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs", help="folder of coverage.md / coverage.json"
    )
    parser.add_argument("--resume", action="store_true", help="check only the types the table lacks")
    args = parser.parse_args()
    types = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    unknown = sorted(set(args.only or ()) - set(types))
    if unknown:
        parser.error(f"not causal-LM types of transformers {transformers.__version__}: {', '.join(unknown)}")
    data_file = args.out / "coverage.json"
    entries = load(data_file) if (args.only or args.resume) and data_file.is_file() else {}
    todo = args.only or [t for t in types if not (args.resume and t in entries)]
    with Progress() as progress:
        task = progress.add_task("catalogue", total=len(todo))
        for model_type in todo:
            progress.update(task, description=model_type)
            start = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix=f"catalogue-{model_type}-") as work:
                try:
                    entry = check(model_type, Path(work))
                except subprocess.TimeoutExpired as e:
                    entry = Entry(model_type, "CRASH", f"`{' '.join(e.cmd[3:5])}` ran over {TIMEOUT_S} s")
            entry.seconds = round(time.perf_counter() - start, 1)
            entry.hybrid = entry.status not in ("OUT OF SCOPE", "NO FIXTURE") and bool(
                carried_state(model_type)
            )
            entries[model_type] = entry
            write(args.out, entries)  # after every type: an interrupted sweep keeps what it checked
            progress.console.print(f"{model_type:28} {entry.status:12} {entry.reason[:90]}", highlight=False)
            progress.advance(task)


def write(out: Path, entries: dict[str, Entry]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "transformers": transformers.__version__,
        "date": date.today().isoformat(),
        "types": [dataclasses.asdict(entries[t]) for t in sorted(entries)],
    }
    write_text_atomic(out / "coverage.json", json.dumps(payload, indent=1) + "\n")
    write_text_atomic(out / "coverage.md", render(entries))
    if out.resolve() == (ROOT / "docs").resolve():
        update_readme(ROOT / "README.md", entries)


if __name__ == "__main__":
    main()
