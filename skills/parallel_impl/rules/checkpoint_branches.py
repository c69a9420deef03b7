"""Before any layer is sharded, a config branch the checkpoint never takes becomes a guard when the parallel rules
would otherwise have to shard what it builds (the migrator's MG018 keeps such branches general): one whose body
builds a module or parameter sized by the head counts (Cohere's and StableLM's per-head q / k norms, off under
`use_qk_norm` / `qk_layernorm`), one that uses an attribute only such a branch sets, and one that cuts a q/k/v
projection fused on disk (GPT-BigCode's per-head layout, in the `else:` of `if self.multi_query:`), in forward or
in a method forward hands its output to (Falcon's `_split_heads`, a layout per branch), and one that calls one of
several runtime Attention layers (Falcon's ALiBi attention beside its rotary one). What the checkpoint never builds
needs no sharding, and the parallel code refuses a checkpoint that takes the branch
instead of running it with whole layers. Other untaken branches (a weight tie under `tie_word_embeddings`) stay
general."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.call_sites import bound_parameter
from skills.migrator.cst_utils import findall, method
from skills.migrator.rule import Rule
from skills.migrator.rules.checkpoint_branches import guard_untaken_branches
from skills.parallel_impl.rules._units import self_layers
from skills.parallel_impl.rules.attention import FUSED_ON_DISK, builds_from_heads

GUARD = (
    "parallelized for a checkpoint where `{test}` is {value}; ",
    "run `skill migrate` and `skill parallelize` on this checkpoint",
)

SELF_ATTR = m.Attribute(m.Name("self"), m.Name())


def _builds_per_head(node: cst.CSTNode) -> bool:
    return any(builds_from_heads(c) for c in findall(node, m.Call()))


def _per_head_attrs(cls: cst.ClassDef) -> set[str]:
    """`self.x` that an `if` of __init__ sets in a body building per-head modules."""
    init = method(cls, "__init__")
    branches = [b for b in findall(init, m.If()) if _builds_per_head(b.body)] if init else []
    return {t.target.attr.value for b in branches for t in findall(b.body, m.AssignTarget(SELF_ATTR))}


def _cuts_fused_qkv(node: cst.CSTNode) -> bool:
    """node calls a q/k/v projection fused on disk (its output cut one way in this branch, another elsewhere)."""
    return bool(findall(node, m.Call(m.Attribute(m.Name("self"), m.OneOf(*map(m.Name, FUSED_ON_DISK))))))


def _fused_output_names(cls: cst.ClassDef) -> set[str]:
    """The names forward binds a fused q/k/v projection's output to, and the parameters of the methods it passes
    them to (Falcon's `self._split_heads(fused_qkv)`, which cuts it one way per layout). Guarding an untaken branch
    that reads one of them more than needed costs nothing: the checkpoint never runs it."""
    fwd = method(cls, "forward")
    if fwd is None:
        return set()
    fused = m.Call(m.Attribute(m.Name("self"), m.OneOf(*map(m.Name, FUSED_ON_DISK))))
    found = {a.targets[0].target.value for a in findall(fwd, m.Assign([m.AssignTarget(m.Name())], fused))}
    held = m.OneOf(*map(m.Name, found)) if found else None
    for call in findall(fwd, m.Call(SELF_ATTR)) if held else ():
        helper = method(cls, call.func.attr.value)
        given = [a for a in call.args if m.matches(a.value, held)] if helper else []
        found |= {p for a in given if (p := bound_parameter(call, helper, a))}
    return found


def _other_attention(cls: cst.ClassDef) -> set[str]:
    """The runtime `Attention` layers of a class that builds more than one (Falcon's rotary and ALiBi ones)."""
    init = method(cls, "__init__")
    built = self_layers(init, {"Attention"}) if init else {}
    return set(built) if len(built) > 1 else set()


def _needs_guard(cls: cst.ClassDef, branch: cst.If) -> bool:
    """branch builds per-head modules or uses them, cuts a fused q/k/v projection's output (in forward, or in a
    method forward passes it to), or calls one of several runtime Attention layers."""
    used = {a.attr.value for a in findall(branch.body, SELF_ATTR)}
    output = _fused_output_names(cls)
    return (
        _builds_per_head(branch.body)
        or bool(used & _per_head_attrs(cls))
        or _cuts_fused_qkv(branch.body)
        or bool(output and findall(branch.body, m.OneOf(*map(m.Name, output))))
        or bool(used & _other_attention(cls))
    )


class GuardUntakenBranches(Rule):
    ID = "PR008"
    DESCRIPTION = "Untaken config branches that build per-head modules (or use them) become guards."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        return guard_untaken_branches(module, self.rewrite.checkpoint_config, _needs_guard, GUARD, elses=True)
