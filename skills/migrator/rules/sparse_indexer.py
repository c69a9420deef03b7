"""A sparse-attention indexer (DeepSeek's DSA: a light scorer picks, for each query, the context tokens attention
reads) keeps its keys in a cache layer of its own (`k = cache.update_indexer(k, self.layer_idx)`). That cache
becomes the runtime's `IndexKeyCache`, and the indexer's forward runs in its per-request layout:

- its inputs go through `by_request` first (`[batch, tokens, ...]`, each request in a row, as HF scores them);
- the cache update becomes `k, visible = self.index_cache(k, forward_metadata)`: the request's keys, and which of
  them each query may pick, which the forward reads where it read `attention_mask` (a boolean mask, so a branch
  on the mask's dtype takes its boolean arm);
- its callers pass `forward_metadata` on, and the attention that reads the picks takes the arm of its branch on
  `config._attn_implementation` that hands them over as `indices=` (MG005 gives them to the runtime `Attention`
  as `selected=`) instead of scattering them into a mask.

Runs before MG004 would refuse the cache's extra state. Refused by name: an update outside a forward, an indexer
that reads its mask other than as `scores.masked_fill(~attention_mask, ...)` after the update (or not at all: it
would pick other requests' keys), or no `self.head_dim` giving the keys' width."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.call_sites import instance_attrs
from skills.migrator.cst_utils import (
    appended,
    assigned_names,
    is_docstring,
    method,
    param_names,
    rewrite_classes,
    stmt,
    with_forward_metadata,
)
from skills.migrator.rule import Rule
from skills.migrator.rules.fold_hf_only_params import CACHES, HF_ONLY

UPDATE = m.Call(func=m.Attribute(value=m.OneOf(*map(m.Name, CACHES)), attr=m.Name("update_indexer")))
MASK, VISIBLE = "attention_mask", "visible"
_SELF_HEAD_DIM = m.Attribute(m.Name("self"), m.Name("head_dim"))
HEAD_DIM = m.Assign([m.AssignTarget(_SELF_HEAD_DIM)]) | m.AnnAssign(target=_SELF_HEAD_DIM)
BY_IMPLEMENTATION = m.Comparison(  # `self.config._attn_implementation in ("eager", "sdpa")` or `== "eager"`
    left=m.Attribute(attr=m.Name("_attn_implementation")),
    comparisons=[m.ComparisonTarget(m.In() | m.Equal(), m.Tuple() | m.SimpleString())],
)
NONE_INIT = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())], m.Name("None"))])
BOOL_DTYPE = m.Comparison(
    left=m.Attribute(m.Name(MASK), m.Name("dtype")),
    comparisons=[m.ComparisonTarget(m.Equal(), m.Attribute(m.Name("torch"), m.Name("bool")))],
)
INVERTED = m.UnaryOperation(operator=m.BitInvert(), expression=m.Name(MASK))
MASKED_FILL = m.Call(func=m.Attribute(attr=m.Name("masked_fill")), args=[m.Arg(INVERTED), m.ZeroOrMore()])


def _update_line(fn: cst.FunctionDef) -> tuple[cst.BaseStatement, str] | None:
    """(the top-level statement holding `k = cache.update_indexer(k, ...)`, bare or under `if cache is not
    None:`, and k)."""
    assign = m.Assign([m.AssignTarget(m.Name())], UPDATE)
    for s in fn.body.body:
        inner = s.body.body[0] if isinstance(s, cst.If) and len(s.body.body) == 1 and not s.orelse else s
        if m.matches(inner, m.SimpleStatementLine([assign])):
            return s, inner.body[0].targets[0].target.value
    return None


class _Indexer(cst.CSTTransformer):
    """The indexer's forward: the update replaced, the branch on the mask's dtype folded to its boolean arm, the
    mask read as `visible`."""

    def __init__(self, update: cst.BaseStatement, key: str):
        self.update, self.key = update, key

    def leave_IndentedBlock(
        self, original: cst.IndentedBlock, updated: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        body: list[cst.BaseStatement] = []
        for s in updated.body:
            if _on_dtype(s):
                body += s.body.body
            else:
                body.append(s)
        return updated.with_changes(body=body)

    def leave_If(self, original: cst.If, updated: cst.If):
        return self._update(original, updated)

    def leave_SimpleStatementLine(self, original, updated):
        return self._update(original, updated)

    def _update(self, original: cst.BaseStatement, updated: cst.BaseStatement) -> cst.BaseStatement:
        if original is self.update:
            return stmt(f"{self.key}, {VISIBLE} = self.index_cache({self.key}, forward_metadata)")
        return updated

    def leave_UnaryOperation(self, original, updated):
        return updated.with_changes(expression=cst.Name(VISIBLE)) if m.matches(updated, INVERTED) else updated


def _masks_only(fwd: cst.FunctionDef, update: cst.BaseStatement) -> bool:
    """Whether forward reads the mask only as `scores.masked_fill(~attention_mask, ...)`, after the update and once
    a branch on its dtype is folded to its boolean arm (as `_Indexer` leaves it)."""
    body = list(fwd.body.body)
    i = body.index(update)
    kept = [x for s in body[i + 1 :] for x in (s.body.body if _on_dtype(s) else [s])]
    reads = sum(len(m.findall(x, m.Name(MASK))) for x in kept)
    masking = sum(len(m.findall(x, MASKED_FILL)) for x in kept)
    before = sum(len(m.findall(x, m.Name(MASK))) for x in body[:i])
    return before == 0 and 0 < masking == reads


def _on_dtype(s: cst.BaseStatement) -> bool:
    return isinstance(s, cst.If) and m.matches(s.test, BOOL_DTYPE)


def _per_request(fn: cst.FunctionDef) -> list[cst.BaseStatement]:
    """`x = by_request(x, forward_metadata)` for each input the runtime does not fold away."""
    kept = [p for p in param_names(fn)[1:] if p not in HF_ONLY and p not in ("position_ids", "kwargs")]
    return [stmt(f"{p} = by_request({p}, forward_metadata)") for p in kept]


class _PassMetadata(cst.CSTTransformer):
    """Calls of the indexer modules (`self.<attr>(...)`) pass forward_metadata; the functions making them
    take it."""

    def __init__(self, attrs: set[str]):
        self.attrs = attrs
        self.calls: list[bool] = []  # per enclosing function: whether it calls an indexer

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.calls.append(False)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not self.calls or not m.matches(
            updated.func, m.Attribute(m.Name("self"), m.OneOf(*map(m.Name, self.attrs)))
        ):
            return updated
        self.calls[-1] = True
        return appended(updated, "forward_metadata", "forward_metadata")

    def leave_FunctionDef(self, original, updated):
        return with_forward_metadata(updated) if self.calls.pop() else updated


class _HandOverPicks(cst.CSTTransformer):
    """`if self.config._attn_implementation ...: <mask from the picks> else: indices = picks` -> the else arm,
    without a `indices = None` right before it that the arm overwrites."""

    def __init__(self, indices: set[str]):
        self.indices = indices

    def _arm(self, s: cst.BaseStatement) -> list[cst.BaseStatement] | None:
        """The else arm of an `_attn_implementation` test that binds a name passed as `indices=`."""
        if (
            not isinstance(s, cst.If)
            or not isinstance(s.orelse, cst.Else)
            or not m.matches(s.test, BY_IMPLEMENTATION)
        ):
            return None
        arm = list(s.orelse.body.body)
        return arm if self.indices & set().union(*(assigned_names(a) for a in arm)) else None

    def leave_IndentedBlock(
        self, original: cst.IndentedBlock, updated: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        body: list[cst.BaseStatement] = []
        for s in updated.body:
            if (arm := self._arm(s)) is None:
                body.append(s)
                continue
            bound = set().union(*(assigned_names(a) for a in arm))
            if body and m.matches(body[-1], NONE_INIT) and body[-1].body[0].targets[0].target.value in bound:
                body.pop()
            body += arm
        return updated.with_changes(body=body)


class SparseIndexer(Rule):
    ID = "MG032"
    DESCRIPTION = (
        "A sparse-attention indexer's key cache becomes the runtime's IndexKeyCache (by_request layout)."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        indexers: set[str] = set()

        def convert(cls: cst.ClassDef) -> cst.ClassDef | None:
            if new := self._indexer(cls.name.value, cls):
                indexers.add(cls.name.value)
            return new

        module = rewrite_classes(module, convert)
        if not indexers:
            return module
        module = rewrite_classes(module, lambda cls: _hand_over(cls, indexers))
        self.add_needed_imports(
            [
                ("runtime.layers.index_cache", "IndexKeyCache"),
                ("runtime.layers.index_cache", "by_request"),
                ("runtime.engine.forward_metadata", "ForwardMetaData"),
            ]
        )
        return module

    def _indexer(self, name: str, cls: cst.ClassDef) -> cst.ClassDef | None:
        updating = [fn for fn in m.findall(cls.body, m.FunctionDef()) if m.findall(fn, UPDATE)]
        if not updating:
            return None
        fwd, init = method(cls, "forward"), method(cls, "__init__")
        found = _update_line(fwd) if updating == [fwd] else None
        why = (
            "outside its forward, or not as `k = cache.update_indexer(k, ...)` at the forward's top level"
            if found is None
            else "it does not mask its scores with `attention_mask` (as `scores.masked_fill(~attention_mask, "
            "...)` after the update, the mask read nowhere else), so it could pick other requests' keys"
            if not _masks_only(fwd, found[0])
            else "no `self.head_dim` in `__init__` gives its keys' width"
            if init is None or not m.findall(init, HEAD_DIM)
            else None
        )
        if why:
            self.rewrite.unsupported(
                name, 0, f"a sparse-attention indexer's key cache (`update_indexer`): {why}"
            )
            return None
        update, key = found
        legacy = ", legacy=True" if self.rewrite.kv_layout == "legacy" else ""
        ctor = stmt(f"self.index_cache = IndexKeyCache(self.head_dim{legacy})")
        new_fwd = with_forward_metadata(fwd.with_changes(body=fwd.body.visit(_Indexer(update, key))))
        body = list(new_fwd.body.body)
        first = 1 if body and is_docstring(body[0]) else 0
        new_fwd = new_fwd.with_changes(
            body=new_fwd.body.with_changes(body=[*body[:first], *_per_request(fwd), *body[first:]])
        )
        new_init = init.with_changes(body=init.body.with_changes(body=[*init.body.body, ctor]))
        swap = {id(fwd): new_fwd, id(init): new_init}
        return cls.with_changes(body=cls.body.with_changes(body=[swap.get(id(s), s) for s in cls.body.body]))


def _hand_over(cls: cst.ClassDef, indexers: set[str]) -> cst.ClassDef | None:
    """A class holding an indexer (`self.X = Indexer(...)`, or `None if ... else Indexer(...)`): its calls pass
    forward_metadata on, and it hands the picks over as `indices=`; None for other classes."""
    init = method(cls, "__init__")
    attrs = {a for a, (c, is_list) in (instance_attrs(init, indexers) if init else {}).items() if not is_list}
    if not attrs:
        return None
    cls = cls.visit(_PassMetadata(attrs))
    indices = {a.value.value for a in m.findall(cls, m.Arg(m.Name(), keyword=m.Name("indices")))}
    return cls.visit(_HandOverPicks(indices)) if indices else cls
