"""Parameters that only serve HF's generate / training API (`cache`, `use_cache`, `attention_mask`,
`inputs_embeds`, `labels`, `output_attentions`, `logits_to_keep`, ...) and cross-attention's encoder states (a
causal LM runs without an encoder) are removed from every signature but that of a helper method its own class
calls with a value computed at run time, and of a function that computes on the encoder's states whatever they
are (a cross-attention class of its own, which the model no longer calls). Their values are known under the
runtime contract, so branches on them (and flags tested on them, `is_cross_attention = key_value_states is not
None`) are folded away, call arguments forwarding them are dropped, and
`**kwargs: Unpack[...]` loses its annotation. A module that keeps its own state in the cache (calls a method of
`cache.layers[i]`, or of the cache other than `update`) is refused: folding its cache away would silently
forget that state between steps, and the runtime caches only keys and values. So is a module whose input parameter
(`inputs_embeds`, an encoder's states) a call the model makes passes a value computed at run time (BLT feeds its
global transformer the local encoder's patch states): folding it would lose that input."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.call_sites import binding, bound_parameter, call_sites, named_params
from skills.migrator.cst_utils import (
    Transformer,
    assigned_names,
    classes,
    code,
    findall,
    free_names,
    method,
    param_names,
    with_args,
    without_dangling_comma,
)
from skills.migrator.past_positions import fed_past_length, pass_positions
from skills.migrator.reachability import reachable
from skills.migrator.rule import Rule

HF_ONLY: dict[str, object] = {
    "cache": None,
    "past_key_values": None,
    "past_key_value": None,
    "layer_past": None,
    "use_cache": False,
    "attention_mask": None,
    "inputs_embeds": None,
    "labels": None,
    "output_attentions": False,
    "output_hidden_states": False,
    "output_router_logits": False,
    "cache_position": None,
    "logits_to_keep": 0,
    "head_mask": None,
    # a causal LM runs without an encoder: cross-attention has no states to read
    "encoder_hidden_states": None,
    "encoder_attention_mask": None,
    "key_value_states": None,
    "return_dict": True,  # the runtime reads the model's hidden states, never its tuple form
}
_ZERO = m.SubscriptElement(m.Index(m.Integer("0")))
SINGLETONS = {"True": True, "False": False, "None": None}
ALWAYS_GIVEN = {"input_ids", "position_ids", "forward_metadata"}
ENCODER = {"encoder_hidden_states", "encoder_attention_mask", "key_value_states"}
# inputs a module computes on, not masks or flags: a value computed for them is an input the model would lose
INPUTS = {"inputs_embeds", "encoder_hidden_states", "key_value_states"}
# what folding an encoder's states to None leaves in a function that needs them (cross-attention itself)
ON_NONE = (
    m.Attribute(value=m.Name("None"))
    | m.Subscript(value=m.Name("None"))
    | m.Call(m.Attribute(m.Name("self")), [m.Arg(m.Name("None"), keyword=None), m.ZeroOrMore()])
)

# the HF-only parameters that hold a Cache
CACHES = {"cache", "past_key_values", "past_key_value", "layer_past"}
GRADIENT_CHECKPOINTING = m.Attribute(value=m.Name("self"), attr=m.Name("gradient_checkpointing"))


def _literal(value: object) -> cst.BaseExpression:
    return cst.Integer(str(value)) if type(value) is int else cst.Name(repr(value))


class _Env:
    """consts: removed parameters, whose reads become literals; facts: locals assigned a literal (after
    folding, as `use_cache = False`), known to branch tests only; given: names never None."""

    def __init__(
        self,
        consts: dict[str, object],
        given: set[str],
        facts: dict[str, object] | None = None,
        drop_forwarding: bool = True,
    ):
        self.consts, self.given, self.facts = consts, given, facts or {}
        self.drop_forwarding = drop_forwarding  # `f(x=x)` of a removed x goes: f lost its parameter too

    def copy(self) -> "_Env":
        return _Env(dict(self.consts), set(self.given), dict(self.facts), self.drop_forwarding)

    def forget(self, names: set[str]) -> None:
        for n in names:
            self.consts.pop(n, None)
            self.facts.pop(n, None)
            self.given.discard(n)

    def known(self, name: str) -> tuple[bool, object]:
        for values in (self.consts, self.facts):
            if name in values:
                return True, values[name]
        return False, None

    def truth(self, e: cst.BaseExpression):
        """True / False when the value is known under the contract, else None."""
        if m.matches(e, GRADIENT_CHECKPOINTING):
            return False
        if isinstance(e, cst.Name):
            found, value = self.known(e.value)
            if found:
                return bool(value)
            return {"True": True, "False": False, "None": False}.get(e.value)
        if isinstance(e, cst.UnaryOperation) and isinstance(e.operator, cst.Not):
            v = self.truth(e.expression)
            return None if v is None else not v
        if isinstance(e, cst.BooleanOperation):
            a, b = self.truth(e.left), self.truth(e.right)
            if isinstance(e.operator, cst.And):
                return False if False in (a, b) else (True if a is b is True else None)
            return True if True in (a, b) else (False if a is b is False else None)
        if isinstance(e, cst.BinaryOperation) and isinstance(e.operator, cst.BitXor):
            a, b = self.truth(e.left), self.truth(e.right)
            return None if None in (a, b) else a != b
        if isinstance(e, cst.Comparison) and len(e.comparisons) == 1 and isinstance(e.left, cst.Name):
            op, right = e.comparisons[0].operator, e.comparisons[0].comparator
            if m.matches(right, m.OneOf(*map(m.Name, SINGLETONS))) and isinstance(op, (cst.Is, cst.IsNot)):
                found, value = self.known(e.left.value)
                if not found and e.left.value in SINGLETONS:  # a literal once folded: `False is True`
                    found, value = True, SINGLETONS[e.left.value]
                given = right.value == "None" and e.left.value in self.given  # what the runtime passes
                same = value is SINGLETONS[right.value] if found else False if given else None
                return None if same is None else same == isinstance(op, cst.Is)
        return None


def _bound(original: cst.BaseExpression, updated: cst.BaseExpression) -> cst.BaseExpression:
    """An assignment target with the names it binds restored (`attention_mask, x = ...` keeps both)."""
    if isinstance(original, cst.Name):
        return original
    if isinstance(original, (cst.Tuple, cst.List)):
        return updated.with_changes(
            elements=[
                new.with_changes(value=_bound(old.value, new.value))
                for old, new in zip(original.elements, updated.elements, strict=True)
            ]
        )
    return updated


class _Substitute(Transformer):
    """Drops keyword arguments that forward known values; replaces other reads by literals."""

    def __init__(self, env: _Env):
        self.env = env

    def leave_Call(self, original, updated):
        if not self.env.drop_forwarding:
            return updated
        args = [
            new
            for old, new in zip(original.args, updated.args, strict=True)
            if not (old.keyword and isinstance(old.value, cst.Name) and old.value.value in self.env.consts)
        ]
        return with_args(updated, args)

    def leave_Name(self, original, updated):
        return _literal(self.env.consts[updated.value]) if updated.value in self.env.consts else updated

    # names in these positions are not reads
    def leave_Attribute(self, original, updated):
        return updated.with_changes(attr=original.attr)

    def leave_Arg(self, original, updated):
        return updated.with_changes(keyword=original.keyword)

    def leave_AssignTarget(self, original, updated):
        return updated.with_changes(target=_bound(original.target, updated.target))

    def leave_AnnAssign(self, original, updated):
        return updated.with_changes(target=_bound(original.target, updated.target))

    def leave_NamedExpr(self, original, updated):
        return updated.with_changes(target=original.target)

    def leave_Param(self, original, updated):
        return updated.with_changes(name=original.name)

    def leave_IfExp(self, original, updated):
        v = self.env.truth(original.test)
        if v is None and updated.body.deep_equals(updated.orelse) and not findall(updated.test, m.Call()):
            return updated.body  # both sides folded to the same value
        return updated if v is None else (updated.body if v else updated.orelse)


NAMED = {"True": True, "False": False, "None": None}
LITERAL = m.Name("True") | m.Name("False") | m.Name("None") | m.Integer()
LITERAL_ASSIGN = m.SimpleStatementLine([m.Assign(targets=[m.AssignTarget(m.Name())], value=LITERAL)])
TEST_ASSIGN = m.SimpleStatementLine(
    [m.Assign([m.AssignTarget(m.Name())], m.Comparison() | m.BooleanOperation() | m.UnaryOperation(m.Not()))]
)


def _fold_block(body, env: _Env) -> list:
    out = []
    for s in body:
        folded = _fold_stmt(s, env)
        for f in folded:
            env.forget(assigned_names(f))
            env.facts.update(_if_facts(f) if isinstance(f, cst.If) else _literal_facts([f]))
        out.extend(folded)
    return out


def fold_known(body, consts: dict[str, object]) -> list:
    """body's statements with the names in consts read as those literals (arguments forwarding them too) and the
    branches they decide folded."""
    return _fold_block(body, _Env(dict(consts), set(), drop_forwarding=False))


def fold_given(body, given: set[str]) -> list:
    """body's statements with the names in `given` never None, the branches that test so folded."""
    return _fold_block(body, _Env({}, set(given), drop_forwarding=False))


def _literal_facts(stmts) -> dict[str, object]:
    """Locals the statements leave holding a literal (`use_cache = False` once folded)."""
    facts: dict[str, object] = {}
    for f in stmts:
        for name in assigned_names(f):
            facts.pop(name, None)
        if m.matches(f, LITERAL_ASSIGN):
            name, value = f.body[0].targets[0].target.value, f.body[0].value
            facts[name] = value.evaluated_value if isinstance(value, cst.Integer) else NAMED[value.value]
    return facts


def _if_facts(s: cst.If) -> dict[str, object]:
    """Locals every branch of an if / elif / else leaves holding the same literal."""
    if s.orelse is None:
        return {}
    body = _literal_facts(s.body.body)
    other = _if_facts(s.orelse) if isinstance(s.orelse, cst.If) else _literal_facts(s.orelse.body.body)
    return {k: v for k, v in body.items() if k in other and repr(other[k]) == repr(v)}


def _block(node, stmts):
    return node.with_changes(body=stmts or [cst.SimpleStatementLine([cst.Pass()])])


def _fold_stmt(s, env: _Env) -> list:
    if isinstance(s, cst.If):
        v = env.truth(s.test)
        if v is True:
            return _fold_block(s.body.body, env)
        if v is False:
            if s.orelse is None:
                return []
            return (
                _fold_stmt(s.orelse, env)
                if isinstance(s.orelse, cst.If)
                else _fold_block(s.orelse.body.body, env)
            )
        orelse = s.orelse
        if isinstance(orelse, cst.Else):
            orelse = orelse.with_changes(body=_block(orelse.body, _fold_block(orelse.body.body, env.copy())))
        elif isinstance(orelse, cst.If):
            folded = _fold_stmt(orelse, env.copy())
            orelse = (
                folded[0]
                if len(folded) == 1 and isinstance(folded[0], cst.If)
                else (cst.Else(cst.IndentedBlock(folded)) if folded else None)
            )
        body = _block(s.body, _fold_block(s.body.body, env.copy()))
        pure_test = not findall(s.test, m.Call() | m.NamedExpr())
        if isinstance(orelse, cst.Else) and orelse.body.deep_equals(body) and pure_test:
            return list(body.body)  # both branches folded to the same code (`use_cache = False`)
        return [s.with_changes(test=s.test.visit(_Substitute(env)), body=body, orelse=orelse)]
    if isinstance(s, (cst.For, cst.While, cst.With)):
        head = {
            k: getattr(s, k).visit(_Substitute(env))
            for k in ("iter", "test", "items")
            if hasattr(s, k) and not isinstance(getattr(s, k), (list, tuple))
        }
        inner = env.copy()
        inner.forget(assigned_names(s))
        return [s.with_changes(**head, body=_block(s.body, _fold_block(s.body.body, inner)))]
    if m.matches(s, TEST_ASSIGN) and not findall(s, m.Call() | m.NamedExpr()):
        v = env.truth(s.body[0].value)  # `is_cross_attention = key_value_states is not None`: False
        if v is not None:
            return [s.with_changes(body=[s.body[0].with_changes(value=cst.Name(str(v)))])]
    return [s.visit(_Substitute(env))]


class _Fold(Transformer):
    def __init__(self, kept: dict[tuple[str, str], set[str]]):
        self.kept, self.classes = kept, []

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.classes.append(node.name.value)

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        self.classes.pop()
        return updated

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if findall(updated.body, GRADIENT_CHECKPOINTING):  # inference never checkpoints
            updated = updated.with_changes(
                body=_block(updated.body, _fold_block(updated.body.body, _Env({}, set())))
            )
        params = updated.params
        names = [p.name.value for p in (*params.params, *params.kwonly_params)]
        kept = self.kept.get((self.classes[-1], updated.name.value), set()) if self.classes else set()
        consts = {n: HF_ONLY[n] for n in names if n in HF_ONLY and n not in kept}

        def folded(consts: dict[str, object]) -> list | None:
            env = _Env(dict(consts), set(names) & ALWAYS_GIVEN)  # folding forgets what the body rebinds
            return _fold_block(updated.body.body, env) if consts else None

        body = folded(consts)
        if ENCODER & consts.keys() and any(findall(s, ON_NONE) for s in body):
            consts = {n: v for n, v in consts.items() if n not in ENCODER}  # it needs them: it stays as it is
            body = folded(consts)
        star_kwargs = params.star_kwarg
        if star_kwargs is not None and star_kwargs.annotation is not None:
            star_kwargs = star_kwargs.with_changes(annotation=None)
        positional = [p for p in params.params if p.name.value not in consts]
        kwonly = [p for p in params.kwonly_params if p.name.value not in consts]
        if params.star_kwarg is None:  # what ends the signature leaves no comma dangling
            if params.kwonly_params:
                kwonly = without_dangling_comma(kwonly, params.kwonly_params)
            elif not isinstance(params.star_arg, cst.Param):
                positional = without_dangling_comma(positional, params.params)
        new_params = params.with_changes(params=positional, kwonly_params=kwonly, star_kwarg=star_kwargs)
        if body is None:
            return updated.with_changes(params=new_params)
        return updated.with_changes(params=new_params, body=_block(updated.body, body))


def _forward_of(cls: cst.ClassDef) -> cst.FunctionDef | None:
    """What calling an instance runs: its forward, unless it defines __call__."""
    return None if method(cls, "__call__") else method(cls, "forward")


def _bound_to_hf_only(module: cst.Module) -> set[int]:
    """ids of the arguments in-file calls bind to the HF-only parameters of in-file classes' methods and
    functions, whatever the argument's name (OPT passes its position mask to its embedding positionally): they go
    too."""
    local, doomed = classes(module), set()
    for name, where in call_sites(module).items():
        forward = _forward_of(local[name])
        for fn, calls in ((method(local[name], "__init__"), where.constructed), (forward, where.called)):
            for param in named_params(fn) if fn is not None else ():
                if param.name.value in HF_ONLY:
                    doomed |= {id(a) for c in calls if (a := binding(c, fn, param)) is not None}
    # module-level helpers too (LFM2's `apply_mask_to_padding_states(hidden_states, attention_mask)`)
    for fn in (s for s in module.body if isinstance(s, cst.FunctionDef)):
        calls = findall(module, m.Call(func=m.Name(fn.name.value)))
        for param in named_params(fn):
            if param.name.value in HF_ONLY:
                doomed |= {id(a) for c in calls if (a := binding(c, fn, param)) is not None}
    return doomed


def _mixed_list_bindings(module: cst.Module) -> tuple[set[int], list[tuple[str, str]]]:
    """For calls of a list's items that may be instances of several classes (Zamba's hybrid and Mamba layers):
    ids of the arguments every class binds to an HF-only parameter, which go; and (classes, argument) for an
    argument some bind to one and others not, which no removal keeps right for all."""
    local, shared = classes(module), {}
    for name, where in call_sites(module).items():
        forward = _forward_of(local[name])
        for c in where.shared:
            shared.setdefault(id(c), (c, {}))[1][name] = forward
    doomed, conflicts = set(), []
    for call, forwards in shared.values():
        for a in call.args:
            folded = {fn is not None and bound_parameter(call, fn, a) in HF_ONLY for fn in forwards.values()}
            if folded == {True}:
                doomed.add(id(a))
            elif len(folded) > 1:
                conflicts.append((", ".join(sorted(forwards)), code(a.value)))
    return doomed, conflicts


def _inputs_fed_at_run_time(module: cst.Module, entry_class: str) -> list[tuple[str, str, str]]:
    """(class, parameter, argument) for each in-file call, in a class the entry class reaches, that binds an input
    parameter of its forward (`inputs_embeds`, an encoder's states) to a value computed at run time rather than
    forwarding the caller's own HF-only parameter: folding the parameter away would lose that input (BLT's
    global transformer is fed the local encoder's patch states as `inputs_embeds`)."""
    kept = [module.body[i] for i in reachable(module, {entry_class})]
    made = {id(c) for s in kept for c in findall(s, m.Call())}  # the calls the migrated model makes
    local, fed = classes(module), []
    forwarded = m.OneOf(*map(m.Name, HF_ONLY))
    for name, where in call_sites(module).items():
        forward = method(local[name], "forward")
        for param in named_params(forward) if forward is not None else ():
            if param.name.value in INPUTS:
                for call in (c for c in where.called if id(c) in made):
                    arg = binding(call, forward, param)
                    if arg is not None and not _is_literal(arg.value) and not m.matches(arg.value, forwarded):
                        fed.append((name, param.name.value, code(arg.value)))
    return fed


def _is_literal(e: cst.BaseExpression) -> bool:
    return isinstance(e, cst.Integer) or m.matches(e, m.Name("None") | m.Name("True") | m.Name("False"))


def _helper_bindings(module: cst.Module) -> tuple[dict[tuple[str, str], set[str]], set[int]]:
    """HF-only parameters of a class's other methods (forward and __init__ are _bound_to_hf_only's) that one of
    its `self.method(...)` calls passes a value computed at run time: those stay, as folding them would change
    what the method computes (Gemma 4's `get_per_layer_inputs(input_ids, inputs_embeds)` gets the embeddings
    its caller just looked up). ids of the arguments bound to the others, which go with their parameters."""
    bindings = []  # (class, method, parameter, argument, whether the argument is a known constant)
    for name, cls in classes(module).items():
        fns = [f for f in cls.body.body if isinstance(f, cst.FunctionDef)]
        helpers = {f.name.value: f for f in fns if f.name.value not in ("forward", "__init__")}
        for caller in fns:
            folded = {p.name.value for p in named_params(caller) if p.name.value in HF_ONLY}
            folded -= assigned_names(caller.body)
            for call in findall(caller.body, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name()))):
                fn = helpers.get(call.func.attr.value)
                for param in named_params(fn) if fn is not None else ():
                    if param.name.value in HF_ONLY and (arg := binding(call, fn, param)) is not None:
                        known = _is_literal(arg.value) or m.matches(arg.value, m.OneOf(*map(m.Name, folded)))
                        bindings.append((name, fn.name.value, param.name.value, arg, known))
    kept: dict[tuple[str, str], set[str]] = {}
    for cls_name, fn_name, param, _, known in bindings:
        if not known:
            kept.setdefault((cls_name, fn_name), set()).add(param)
    doomed = {id(arg) for c, f, param, arg, _ in bindings if param not in kept.get((c, f), set())}
    return kept, doomed


def cache_state_methods(fn: cst.FunctionDef) -> list[str]:
    """Methods by which fn keeps state other than keys and values in a cache parameter: `store` of each
    `cache.layers[i].store(...)` (directly or through a local bound to `cache.layers[i]`), and any method of
    the cache itself but the keys-and-values `update` (ZAYA's `cache.update_conv_state(...)`). Reads (`get_*`)
    are not state."""
    caches = {p.name.value for p in named_params(fn)} & CACHES
    if not caches:
        return []
    cache = m.OneOf(*map(m.Name, caches))
    layer = m.Subscript(value=m.Attribute(value=cache, attr=m.Name("layers")))
    held = (
        layer | m.IfExp(body=layer) | m.IfExp(orelse=layer)
    )  # `cache.layers[i] if cache is not None else None`
    holders = {
        a.target.value if isinstance(a, cst.AnnAssign) else a.targets[0].target.value
        for a in findall(fn, m.Assign([m.AssignTarget(m.Name())], held) | m.AnnAssign(m.Name(), value=held))
    }
    layered = findall(fn, m.Call(func=m.Attribute(value=layer | m.OneOf(*map(m.Name, holders)))))
    direct = findall(fn, m.Call(func=m.Attribute(value=cache)))
    names = {c.func.attr.value for c in layered} | ({c.func.attr.value for c in direct} - {"update"})
    return sorted(n for n in names if not n.startswith("get_"))


class _DropArgs(Transformer):
    def __init__(self, doomed: set[int]):
        self.doomed = doomed

    def leave_Arg(self, original: cst.Arg, updated: cst.Arg):
        return cst.RemoveFromParent() if id(original) in self.doomed else updated

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        return updated.with_changes(args=without_dangling_comma(list(updated.args), original.args))


class FoldHFOnlyParams(Rule):
    ID = "MG004"
    DESCRIPTION = "Parameters only HF's generate / training API uses are removed and branches on them folded."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        for name, cls in classes(module).items():
            for fn in findall(cls.body, m.FunctionDef()):
                if found := cache_state_methods(fn):
                    self.rewrite.unsupported(
                        name,
                        0,
                        f"state kept in the cache besides keys and values (`{'`, `'.join(found)}`); the runtime "
                        "caches per-token keys and values only",
                    )
        for name, param, value in _inputs_fed_at_run_time(module, self.rewrite.entry_class):
            self.rewrite.unsupported(
                name,
                0,
                f"its forward is passed `{param}={value}`, computed at run time; the runtime feeds a causal LM "
                f"token ids only and folds `{param}` away, which would lose that input",
            )
        past = _past_lengths(module)
        entry = classes(module).get(self.rewrite.entry_class)
        entry_fwd = method(entry, "forward") if entry is not None else None
        # transformers' generate runs a model whose entry takes no cache on the whole sequence at every step
        uncached = entry_fwd is not None and not set(param_names(entry_fwd)) & (CACHES | {"use_cache"})
        module = pass_positions(
            module, self.rewrite.checkpoint_config, past, self.rewrite.entry_class, uncached
        )
        kept, helper_args = _helper_bindings(module)
        mixed_args, conflicts = _mixed_list_bindings(module)
        for names, arg in conflicts:
            self.rewrite.unsupported(
                self.rewrite.entry_class,
                0,
                f"the layers of one list ({names}) are called with argument `{arg}`, which some of them take as "
                "an HF-only parameter (folded away) and others keep: give them the same signature",
            )
        if doomed := _bound_to_hf_only(module) | helper_args | mixed_args:
            module = module.visit(_DropArgs(doomed))
        module = module.visit(_Fold(kept))
        self._refuse_past_lengths_fed_to_modules(module, past)
        return module

    def _refuse_past_lengths_fed_to_modules(self, module: cst.Module, past: dict[tuple, set[str]]) -> None:
        """A past length read from the cache folds to 0; passed to a module without the positions themselves
        (TrOCR's positional embedding computes them from it), every step's positions would restart at 0."""
        for name, cls in classes(module).items():
            for fn in findall(cls.body, m.FunctionDef()):
                fed = fed_past_length(fn, lengths := past.get((name, fn.name.value), set()))
                if calls := [c for c in fed if not _unread(fn, c)]:
                    length = min(free_names(calls[0]) & lengths)
                    self.rewrite.unsupported(
                        name,
                        0,
                        f"the past length `{length}` read from the cache feeds a module (positions computed "
                        "from it) that does not take `position_ids`, which the runtime passes instead",
                    )
                    return


def _unread(fn: cst.FunctionDef, call: cst.Call) -> bool:
    """call's value is bound to locals fn reads nowhere else (a mask built from the past length, once the
    calls taking it are folded): it goes as dead code, whatever it computed."""
    for a in findall(fn, m.Assign()):
        if a.value is call:
            names = assigned_names(a)
            return all(len(findall(fn, m.Name(n))) == len(findall(a, m.Name(n))) for n in names)
    return False


def _past_lengths(module: cst.Module) -> dict[tuple, set[str]]:
    """(class, function) -> names bound to a past length read from a cache parameter: `cache.get_seq_length()`,
    or the length of the first layer's keys in a tuple cache (`past_key_values[0][0].size(-2)`, `.shape[2]`)."""
    found: dict[tuple, set[str]] = {}
    for name, cls in classes(module).items():
        for fn in findall(cls.body, m.FunctionDef()):
            caches = {p.name.value for p in named_params(fn)} & CACHES
            if not caches:
                continue
            cache = m.OneOf(*map(m.Name, caches))
            keys = m.Subscript(m.Subscript(cache, [_ZERO]), [_ZERO])
            tokens_dim = m.Integer("2") | m.UnaryOperation(m.Minus(), m.Integer("2"))
            read = (
                m.Call(func=m.Attribute(value=cache, attr=m.Name("get_seq_length")))
                | m.Call(m.Attribute(keys, m.Name("size")), [m.Arg(tokens_dim)])
                | m.Subscript(m.Attribute(keys, m.Name("shape")), [m.SubscriptElement(m.Index(tokens_dim))])
            )
            for a in findall(fn, m.Assign()):
                if findall(a.value, read):
                    found.setdefault((name, fn.name.value), set()).update(assigned_names(a))
    return found
