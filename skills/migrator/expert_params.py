"""Parameters stacked per expert, read off a constructor: the weights of an experts module (transformers' MoE
layers hold every routed expert as one `[num_experts, ...]` tensor per projection)."""

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import SELF_ASSIGN_CALL, called_name, code

PARAMETER = frozenset({"nn.Parameter", "torch.nn.Parameter", "Parameter"})
_TENSOR = frozenset({"torch.empty", "torch.zeros", "torch.ones", "torch.randn", "torch.rand"})


@dataclass(frozen=True)
class ExpertParam:
    """`self.<attr> = nn.Parameter(torch.empty(<dims>))`, a top-level statement of `__init__`."""

    attr: str
    line: cst.SimpleStatementLine
    dims: tuple[cst.BaseExpression, ...]


def _param(s: cst.BaseStatement) -> ExpertParam | None:
    if not m.matches(s, SELF_ASSIGN_CALL) or called_name(s.body[0].value) not in PARAMETER:
        return None
    args = s.body[0].value.args
    tensor = args[0].value if args else None
    if not isinstance(tensor, cst.Call) or called_name(tensor) not in _TENSOR:
        return None
    dims = [a.value for a in tensor.args if a.keyword is None]
    if len(dims) == 1 and isinstance(dims[0], cst.Tuple | cst.List):  # torch.empty((E, I, H))
        dims = [e.value for e in dims[0].elements]
    return ExpertParam(s.body[0].targets[0].target.attr.value, s, tuple(dims))


def expert_params(init: cst.FunctionDef) -> list[ExpertParam]:
    """The parameters stacked per expert: those of three or more dims, all led by the same size (the number of
    experts), and the two-dim ones it also leads (per-expert biases). Empty when there are none, or when the
    stacked ones disagree on their leading size."""
    params = [p for s in init.body.body if (p := _param(s)) is not None]
    leads = {code(p.dims[0]) for p in params if len(p.dims) >= 3}
    if len(leads) != 1:
        return []
    return [p for p in params if len(p.dims) >= 2 and code(p.dims[0]) in leads]
