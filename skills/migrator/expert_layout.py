"""What the converted model's MoE layers are, read off the built model for its README: the experts modules
(parameters stacked per expert), and the router beside each with what its forward computes."""

import inspect
import re

from torch import nn


def _stacked(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The module's own parameters stacked per expert (those of >= 3 dims and the ones their leading size leads)."""
    own = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
    leads = {s[0] for s in own.values() if len(s) >= 3}
    if len(leads) != 1:
        return {}
    return {n: s for n, s in own.items() if len(s) >= 2 and s[0] in leads}


def _router(parent: nn.Module, experts: nn.Module, count: int) -> tuple[str, nn.Module] | None:
    """The sibling whose own 2-D weight scores every expert: [num_experts, hidden]."""
    for name, child in parent.named_children():
        if child is not experts and any(
            p.dim() == 2 and p.shape[0] == count for p in child.parameters(recurse=False)
        ):
            return name, child
    return None


def _scoring(router: nn.Module) -> str:
    """What the router's forward computes, from its source and attributes."""
    try:
        source = inspect.getsource(type(router).forward)
    except (OSError, TypeError):
        return "-"
    kind = [f for f in ("sigmoid", "softmax") if re.search(rf"\b{f}\b", source)]
    parts = [f"{'/'.join(kind) or 'linear'} scores", f"top-{getattr(router, 'top_k', '?')}"]
    names = {n for n, _ in router.named_buffers(recurse=False)} | {n for n, _ in router.named_parameters()}
    if any("bias" in n for n in names if n != "weight"):
        parts.append("with bias (" + ", ".join(sorted(n for n in names if "bias" in n)) + ")")
    if getattr(router, "topk_group", None):
        parts.append(f"group-limited ({getattr(router, 'num_group', '?')} groups, best {router.topk_group})")
    renormalised = getattr(router, "norm_topk_prob", None)
    if renormalised or renormalised is None and re.search(r"/=?\s*\w+\.sum\(dim=-1, keepdim=True\)", source):
        parts.append("top-k weights renormalised")
    if (scale := getattr(router, "routed_scaling_factor", None)) not in (None, 1, 1.0):
        parts.append(f"scaled by {scale}")
    return ", ".join(parts)


def expert_layouts(model: nn.Module) -> list[dict]:
    """One row per kind of experts module (built alike), in order of first appearance."""
    modules = dict(model.named_modules())
    rows: dict[tuple, dict] = {}
    for name, module in modules.items():
        stacked = _stacked(module)
        if not stacked:
            continue
        count = next(iter(stacked.values()))[0]
        parent = modules[name.rpartition(".")[0]]
        router = _router(parent, module, count)
        shared = [n for n, _ in parent.named_children() if "shared" in n]
        row = {
            "experts": count,
            "weights": ", ".join(f"`{n}` {list(s)}" for n, s in stacked.items()),
            "router": f"`{router[0]}` ({type(router[1]).__name__})" if router else "-",
            "scoring": _scoring(router[1]) if router else "-",
            "shared": ", ".join(f"`{n}`" for n in shared) or "-",
        }
        entry = rows.setdefault(tuple(row.values()), {"layers": 0, "first": name, **row})
        entry["layers"] += 1
    return list(rows.values())
