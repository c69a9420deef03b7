"""The *ForCausalLM class takes the runtime contract: `forward(input_ids, position_ids, forward_metadata)`
on packed `[T]` inputs returning last-position logits `[B, 1, V]`, explicit weight tying,
`load_weights`, `get_cache_info` on the paged path, and `EntryClass` for the registry."""

import re

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    Transformer,
    assigned_names,
    called_name,
    classes,
    code,
    findall,
    free_names,
    in_file_bases,
    method,
    param_names,
    stmt,
    stmts,
)
from skills.migrator.rule import Rule

FORWARD = """
def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, forward_metadata: ForwardMetaData,
            **kwargs) -> torch.Tensor:
    hidden_states = self.{inner}({ids}=input_ids[None], position_ids=position_ids[None],
                                forward_metadata=forward_metadata, **kwargs)
    hidden_states = hidden_states[{picked}]
"""
CASTS = ("float", "to", "half", "bfloat16", "contiguous")
LAST_POSITIONS = "0, forward_metadata.last_token_indices"
LAST_POSITIONS_SEQ_FIRST = "forward_metadata.last_token_indices, 0"  # the model's states are [T, 1, hidden]
LOAD_WEIGHTS = """
def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    return load_named_weights(self, weights{ignored})
"""
IGNORED = "_keys_to_ignore_on_load_unexpected"
CACHE_INFO = """
def get_cache_info(self) -> ModelCacheInfo:
    return cache_info_of(self, next(self.parameters()).dtype)
"""


def _inner_model_attr(cls: cst.ClassDef, module: cst.Module) -> str | None:
    local = classes(module)
    init = method(cls, "__init__")
    for a in findall(
        init, m.Assign(targets=[m.AssignTarget(m.Attribute(value=m.Name("self")))], value=m.Call())
    ):
        if called_name(a.value) in local:
            return a.targets[0].target.attr.value
    return None


# a parameter's path of attribute names (no regex, no `layers.0` index), written as `self.<path>`
PARAM_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def _tie_statement(cls: cst.ClassDef, inner: str) -> list[cst.BaseStatement]:
    for s in cls.body.body:
        assign = s.body[0] if isinstance(s, cst.SimpleStatementLine) else None
        if m.matches(assign, m.Assign(targets=[m.AssignTarget(m.Name("_tied_weights_keys"))])):
            value = assign.value
            if isinstance(value, cst.Dict) and not value.elements:  # transformers 5's "never tied" (Inkling)
                return []
            if isinstance(value, cst.Dict):
                pairs = [
                    (e.key.evaluated_value, e.value.evaluated_value)
                    for e in value.elements
                    if m.matches(e, m.DictElement(m.SimpleString(), m.SimpleString()))
                ]
            else:
                pairs = [("lm_head.weight", f"{inner}.embed_tokens.weight")]
            ties = "".join(
                f"    self.{dst} = self.{src}\n"
                for dst, src in pairs
                if PARAM_NAME.match(dst) and PARAM_NAME.match(src)
            )
            return stmts(f"if config.tie_word_embeddings:\n{ties}") if ties else []
    return []


def _ignored_keys(cls: cst.ClassDef, module: cst.Module) -> str:
    """`, ignored=[...]`: the checkpoint names transformers ignores for this model (the entry class's or an
    in-file base's `_keys_to_ignore_on_load_unexpected`, a list of literal patterns), else nothing."""
    local = classes(module)
    bases = in_file_bases(local)
    todo, seen = [cls.name.value], set()
    while todo:
        name = todo.pop(0)
        seen.add(name)
        for s in local[name].body.body:
            if m.matches(s, m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name(IGNORED))])])):
                value = s.body[0].value
                literal = isinstance(value, cst.List | cst.Tuple) and all(
                    isinstance(e.value, cst.SimpleString) for e in value.elements
                )
                return f", ignored={code(value)}" if literal and value.elements else ""
        todo += sorted(bases[name] - seen)
    return ""


def _vocab_linears(init: cst.FunctionDef | None) -> list[str]:
    """The attributes init sets to a Linear layer sized by the vocabulary."""
    names = []
    for a in (
        findall(init, m.Assign(targets=[m.AssignTarget(m.Attribute(value=m.Name("self")))], value=m.Call()))
        if init is not None
        else []
    ):
        if called_name(a.value).split(".")[-1] == "Linear" and "vocab_size" in code(a.value):
            names.append(a.targets[0].target.attr.value)
    return names


def _vocab_projection(cls: cst.ClassDef, fwd: cst.FunctionDef, inner: str | None, module: cst.Module) -> str:
    """The output projection, as a path under `self`: `lm_head`, else a Linear layer sized by the vocabulary that
    the entry builds, else one the inner model builds and forward applies (ChatGLM's `transformer.output_layer`)."""
    names = _vocab_linears(method(cls, "__init__"))
    if names:
        return "lm_head" if "lm_head" in names else names[0]
    built = _inner_class(cls, module, inner)
    for attr in _vocab_linears(method(built, "__init__") if built is not None else None):
        if _head_calls(fwd, f"{inner}.{attr}"):
            return f"{inner}.{attr}"
    return "lm_head"


def _applied_inside(built: cst.ClassDef | None) -> tuple[str, cst.ClassDef] | None:
    """(attr, built returning its hidden states) where the inner model's forward ends by applying a Linear layer
    sized by the vocabulary it builds, `self.<attr>`, to its hidden states, perhaps cast (Meta's reference Llama:
    `return self.output(h).float()`): it returns logits, not the hidden states the runtime picks positions of."""
    fwd = method(built, "forward") if built is not None else None
    last = fwd.body.body[-1] if fwd is not None and fwd.body.body else None
    if not m.matches(last, m.SimpleStatementLine([m.Return(m.Call())])):
        return None
    ret = last.body[0]
    value = ret.value
    while m.matches(value, m.Call(m.Attribute(attr=m.OneOf(*map(m.Name, CASTS))), [])):
        value = value.func.value
    for attr in _vocab_linears(method(built, "__init__")):
        if _head_calls(value, attr) == [value] and len(value.args) == 1 and not value.args[0].keyword:
            return attr, built.deep_replace(ret, ret.with_changes(value=value.args[0].value))
    return None


def _first_returned(built: cst.ClassDef | None, fwd: cst.FunctionDef, inner: str) -> cst.ClassDef | None:
    """built returning only the first element of the tuples its forward returns (`return self.ln_f(h), presents`,
    the per-layer cache of older remote code), where the entry reads only that element of what it returns:
    unpacks it (`hidden_states, presents = self.transformer(...)`) or reads `[0]` off it; None otherwise."""
    inner_fwd = method(built, "forward") if built is not None else None
    returns = findall(inner_fwd, m.Return(m.Tuple())) if inner_fwd is not None else []
    if not returns or len(returns) != len(findall(inner_fwd, m.Return())):
        return None
    call = m.Call(m.Attribute(m.Name("self"), m.Name(inner)))
    first_named = m.Tuple([m.Element(m.Name(m.MatchIfTrue(lambda n: n != "_"))), m.ZeroOrMore()])
    unpacked = m.Assign(
        [m.AssignTarget(first_named)], call
    )  # `hidden_states, presents = ...`, not `_, h = ...`
    bound = findall(fwd, m.Assign([m.AssignTarget(m.Name())], call))
    first = [
        n.value.value
        for n in findall(fwd, m.Subscript(m.Name(), [m.SubscriptElement(m.Index(m.Integer("0")))]))
    ]
    read_first = (
        len(bound) == 1
        and (name := bound[0].targets[0].target.value) in first
        and len(findall(fwd, m.Name(name))) == first.count(name) + 1
    )
    if not (findall(fwd, unpacked) or read_first):
        return None
    return built.deep_replace(inner_fwd, inner_fwd.visit(_FirstReturned()))


class _FirstReturned(Transformer):
    def leave_Return(self, original: cst.Return, updated: cst.Return) -> cst.Return:
        if isinstance(updated.value, cst.Tuple):
            return updated.with_changes(value=updated.value.elements[0].value)
        return updated

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return node.name.value == "forward"  # not the returns of a function defined inside it


def _ids_param(built: cst.ClassDef | None) -> str:
    """The inner model's parameter for the token ids: `input_ids`, else its first (Meta's `tokens`)."""
    fwd = method(built, "forward") if built is not None else None
    params = [p for p in param_names(fwd) if p != "self"] if fwd is not None else []
    return "input_ids" if "input_ids" in params or not params else params[0]


def _inner_class(cls: cst.ClassDef, module: cst.Module, inner: str | None) -> cst.ClassDef | None:
    target = m.AssignTarget(m.Attribute(m.Name("self"), m.Name(inner or "")))
    built = findall(method(cls, "__init__"), m.Assign([target], m.Call()))
    return classes(module).get(called_name(built[0].value)) if built else None


def _head_calls(node: cst.CSTNode, head: str) -> list[cst.Call]:
    return [c for c in findall(node, m.Call(func=m.Attribute())) if code(c.func) == f"self.{head}"]


_PAIRS = ([m.Arg(m.Integer(a)), m.Arg(m.Integer(b))] for a, b in (("0", "1"), ("1", "0")))
SWAP = m.Call(func=m.Attribute(attr=m.Name("transpose")), args=m.OneOf(*_PAIRS))


def _logits_name(line: cst.BaseStatement) -> str:
    """The name the output projection's line binds its logits to (ChatGLM's `lm_logits`), else `logits`."""
    single = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())])])
    return line.body[0].targets[0].target.value if m.matches(line, single) else "logits"


def _swapped(s: cst.BaseStatement, name: str) -> bool:
    """s is `name = name.transpose(0, 1)` (then `.contiguous()`, `.float()`, ...): the logits swapped back."""
    line = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name(name))])])
    return m.matches(s, line) and bool(findall(s, SWAP)) and free_names(s.body[0].value) == {name}


def _seq_first(fwd: cst.FunctionDef, head: str) -> bool:
    """forward swaps the first two dimensions of the output projection's result (`.transpose(0, 1)`, on the call
    or on the name a line binds it to): the model's states are [tokens, batch, hidden] (ChatGLM), so the last
    positions are picked along the first."""
    calls = _head_calls(fwd, head)
    if any(any(c is x for c in calls for x in findall(t.func.value, m.Call())) for t in findall(fwd, SWAP)):
        return True
    body = list(fwd.body.body)
    at = next((i for i, s in enumerate(body) if _head_calls(s, head)), None)
    return at is not None and any(_swapped(s, _logits_name(body[at])) for s in body[at + 1 :])


def _head_input(line: cst.BaseStatement, head: str) -> str:
    """What the output projection is applied to: its argument where that is computed from the hidden states alone
    (ModernBERT-decoder's `self.decoder(self.lm_head(hidden_states))` keeps its prediction head), else the
    hidden states (the runtime has already picked the positions HF slices with `logits_to_keep`)."""
    call = _head_calls(line, head)
    if len(call) == 1 and len(call[0].args) == 1 and not call[0].args[0].keyword:
        arg = call[0].args[0].value
        if "hidden_states" in (names := free_names(arg)) and names <= {"self", "hidden_states"}:
            return code(arg)
    return "hidden_states"


IDENTITY = m.SimpleStatementLine(
    [m.Assign([m.AssignTarget(m.Name("hidden_states"))], m.Name("hidden_states"))]
)


class _ReadsModelStates(Transformer):
    """The inner model's output read as `hidden_states`, what the runtime's forward binds its states to: the name
    bound to it (MG006 has made the model return its states), or `.last_hidden_state` or `[0]` off it."""

    def __init__(self, outputs: str):
        self.outputs = m.Name(outputs)

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        return cst.Name("hidden_states") if m.matches(original, self.outputs) else updated

    def leave_Attribute(self, original: cst.Attribute, updated: cst.BaseExpression) -> cst.BaseExpression:
        read = m.Attribute(self.outputs, m.Name("last_hidden_state"))
        return cst.Name("hidden_states") if m.matches(original, read) else updated

    def leave_Subscript(self, original: cst.Subscript, updated: cst.BaseExpression) -> cst.BaseExpression:
        read = m.Subscript(self.outputs, [m.SubscriptElement(m.Index(m.Integer("0")))])
        return cst.Name("hidden_states") if m.matches(original, read) else updated


def _model_states(body: list[cst.BaseStatement], model_call: m.Call) -> "_ReadsModelStates | None":
    """What turns the reads of the inner model's output in body (Inkling's `outputs.last_hidden_state /
    self.config.logits_mup_width_multiplier`) into reads of its states; None where body binds no name to it."""
    binds = m.Assign([m.AssignTarget(m.Name())], model_call) | m.AnnAssign(m.Name(), value=model_call)
    bound = [a for s in body for a in findall(s, binds)]
    if len(bound) != 1:
        return None
    target = bound[0].target if isinstance(bound[0], cst.AnnAssign) else bound[0].targets[0].target
    return _ReadsModelStates(target.value)


def _logits_tail(fwd: cst.FunctionDef, inner: str, head: str) -> list[cst.BaseStatement] | None:
    """The output projection (fed the last positions) with the per-token processing of the hidden states
    before it (MiniCPM's `hidden_states / logits_scaling`) and of the logits after it."""
    body = list(fwd.body.body)
    idx = next((i for i, s in enumerate(body) if _head_calls(s, head)), None)
    if idx is None:
        return None
    logits = _logits_name(body[idx])
    head = stmt(f"{logits} = self.{head}({_head_input(body[idx], head)})\n")
    dropped = {n for s in body[:idx] for n in assigned_names(s)} | set(param_names(fwd)) | {"loss", "outputs"}
    dropped -= {"self", "hidden_states", logits, "input_ids", "position_ids", "kwargs"}
    model_call = m.Call(func=m.Attribute(m.Name("self"), m.Name(inner)))
    position_slice = m.Call(
        func=m.Name("slice_logits_to_keep")
    )  # the runtime picks the last positions itself
    states = _model_states(body[:idx], model_call)
    before = [
        s
        for s in (x.visit(states) if states else x for x in body[:idx])
        if assigned_names(s) == {"hidden_states"}
        and not free_names(s) & dropped
        and not findall(s, model_call | position_slice)
        and not m.matches(s, IDENTITY)
    ]
    after = [
        s
        for s in body[idx + 1 :]
        if not (
            m.matches(s, m.SimpleStatementLine([m.Return()]))
            or free_names(s) & dropped
            or _swapped(s, logits)
        )
    ]
    return [*before, head, *after, stmt(f"return {logits}[:, None, :]\n")]


class CausalLMEntry(Rule):
    ID = "MG007"
    DESCRIPTION = "The *ForCausalLM class takes the runtime contract: forward, load_weights, get_cache_info."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        ctx = self.rewrite
        cls = classes(module).get(ctx.entry_class)
        if cls is None:
            ctx.unsupported(ctx.entry_class, 0, "entry class not found in the modeling file")
            return module
        fwd, init = method(cls, "forward"), method(cls, "__init__")
        if "forward_metadata" in cst.Module([]).code_for_node(fwd):
            return module  # already in contract form
        inner = _inner_model_attr(cls, module)
        head = _vocab_projection(cls, fwd, inner, module)
        tail = None if inner is None else _logits_tail(fwd, inner, head)
        built = new_built = _inner_class(cls, module, inner)
        if tail is None and (inside := _applied_inside(built)) is not None:
            attr, new_built = inside  # the entry applies the inner model's output layer to its hidden states
            tail = [
                stmt(f"logits = self.{inner}.{attr}(hidden_states)\n"),
                stmt("return logits[:, None, :]\n"),
            ]
            head = f"{inner}.{attr}"
        if tail is not None and (first := _first_returned(new_built, fwd, inner)) is not None:
            new_built = first
        if new_built is not built:  # the inner model now returns the hidden states the entry picks from
            module, built = module.deep_replace(built, new_built), new_built
            cls = classes(module)[ctx.entry_class]
            fwd, init = method(cls, "forward"), method(cls, "__init__")
        if inner is None or tail is None:
            ctx.unsupported(
                ctx.entry_class, 0, f"expected `self.<model>(...)` followed by `self.{head}(...)` in forward"
            )
            return module
        picked = LAST_POSITIONS_SEQ_FIRST if _seq_first(fwd, head) else LAST_POSITIONS
        ids = _ids_param(built)
        new_fwd = cst.parse_module(FORWARD.format(inner=inner, ids=ids, picked=picked)).body[0]
        new_fwd = new_fwd.with_changes(
            body=new_fwd.body.with_changes(body=[*new_fwd.body.body, *tail]),
            leading_lines=[cst.EmptyLine(indent=False)],
        )
        new_init = init.with_changes(
            body=init.body.with_changes(body=[*init.body.body, *_tie_statement(cls, inner)])
        )
        extra = [cst.parse_module(LOAD_WEIGHTS.format(ignored=_ignored_keys(cls, module))).body[0]]
        if ctx.kv_layout == "paged":
            extra.append(cst.parse_module(CACHE_INFO).body[0])
        extra = [e.with_changes(leading_lines=[cst.EmptyLine(indent=False)]) for e in extra]
        body = [new_fwd if s is fwd else new_init if s is init else s for s in cls.body.body]
        new_cls = cls.with_changes(body=cls.body.with_changes(body=[*body, *extra]))
        module = module.with_changes(
            body=[new_cls if s is cls else s for s in module.body]
            + [
                stmt(f"EntryClass = {ctx.entry_class}\n").with_changes(
                    leading_lines=[cst.EmptyLine(indent=False), cst.EmptyLine(indent=False)]
                )
            ]
        )
        imports = [
            ("runtime.engine.forward_metadata", "ForwardMetaData"),
            ("collections.abc", "Iterable"),
            ("runtime.layers.weights", "load_named_weights"),
        ]
        if ctx.kv_layout == "paged":
            imports += [("runtime.layers.attention", "cache_info_of"), ("runtime.kv_cache", "ModelCacheInfo")]
        self.add_needed_imports(imports)
        return module
