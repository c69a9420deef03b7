"""A sparse-attention indexer (a light scorer picks, for each query, the context tokens attention reads: DeepSeek's
DSA, MiniMax-M3's blocks of tokens per key head) keeps its keys in a cache layer of its own
(`k = cache.update_indexer(k, self.layer_idx)`, or `cache.layers[self.layer_idx].update_index(k)`). That cache
becomes the runtime's `IndexKeyCache`, and the indexer's forward runs in its per-request layout:

- its inputs go through `by_request` first (`[batch, tokens, ...]`, each request in a row, as HF scores them);
- the cache update becomes `k, visible = self.index_cache(k, forward_metadata)`: the request's keys, and which of
  them each query may pick, which the forward reads where it read `attention_mask` (a boolean mask, so a branch
  on the mask's dtype takes its boolean arm). An indexer that masks the keys past each query by their position
  instead (`position_ids`) keeps doing so: every row holds one request's keys at their positions;
- its callers pass `forward_metadata` on, and the attention that reads the picks hands them over as `indices=`
  (MG005 gives them to the runtime `Attention` as `selected=`) instead of scattering them into a mask: the arm of
  a branch on `config._attn_implementation` that does so is taken, one that only builds the mask is dropped.
  Picks that number blocks (the mask builder expands them with `repeat_interleave(self.<size>, dim=-1)`) pass
  that size as `index_block=` (the runtime's `select_block`).

Runs before MG004 would refuse the cache's extra state. Refused by name: an update outside a forward, an indexer
that masks its scores neither with its mask (as `scores.masked_fill(~attention_mask, ...)` after the update, the
mask read nowhere else) nor by position (it would pick other requests' keys), no `self.head_dim` giving the keys'
width, or a block size not set from the config."""

from collections.abc import Collection

import libcst as cst
import libcst.matchers as m

from skills.migrator.call_sites import binding, instance_attrs, named_params
from skills.migrator.cst_utils import (
    Transformer,
    appended,
    assigned_names,
    called_name,
    classes,
    code,
    findall,
    free_names,
    is_docstring,
    kwarg,
    method,
    param_names,
    rewrite_classes,
    stmt,
    with_forward_metadata,
)
from skills.migrator.rule import Rule
from skills.migrator.rules.fold_hf_only_params import CACHES, HF_ONLY
from skills.migrator.rules.runtime_attention import INTERFACE

_CACHE = m.OneOf(*map(m.Name, CACHES))
UPDATE = m.Call(func=m.Attribute(value=_CACHE, attr=m.Name("update_indexer"))) | m.Call(
    func=m.Attribute(
        value=m.Subscript(value=m.Attribute(_CACHE, m.Name("layers"))), attr=m.Name("update_index")
    )
)
MASK, VISIBLE, POSITIONS = "attention_mask", "visible", "position_ids"
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
ANY_MASKED_FILL = m.Call(func=m.Attribute(attr=m.Name("masked_fill")), args=[m.Arg(), m.ZeroOrMore()])
_SELF_ATTR = m.Attribute(m.Name("self"), m.Name())
BLOCKS_TO_KEYS = m.Call(  # `keep.repeat_interleave(self.block_size, dim=-1)`: a verdict per block, per key
    func=m.Attribute(attr=m.Name("repeat_interleave")),
    args=[m.Arg(_SELF_ATTR), m.Arg(m.UnaryOperation(m.Minus(), m.Integer("1")))],
)


def _update_line(fn: cst.FunctionDef) -> tuple[cst.BaseStatement, str] | None:
    """(the top-level statement holding `k = cache.update_indexer(k, ...)`, bare or under `if cache is not
    None:`, and k)."""
    assign = m.Assign([m.AssignTarget(m.Name())], UPDATE)
    for s in fn.body.body:
        inner = s.body.body[0] if isinstance(s, cst.If) and len(s.body.body) == 1 and not s.orelse else s
        if m.matches(inner, m.SimpleStatementLine([assign])):
            return s, inner.body[0].targets[0].target.value
    return None


class _Indexer(Transformer):
    """The indexer's forward: the update replaced, the branch on the mask's dtype folded to its boolean arm, the
    mask read as `visible`."""

    def __init__(self, update: cst.BaseStatement, key: str, by_position: bool):
        self.update, self.key, self.visible = update, key, "_" if by_position else VISIBLE

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
            return stmt(f"{self.key}, {self.visible} = self.index_cache({self.key}, forward_metadata)")
        return updated

    def leave_UnaryOperation(self, original, updated):
        return updated.with_changes(expression=cst.Name(VISIBLE)) if m.matches(updated, INVERTED) else updated


def _masks_only(fwd: cst.FunctionDef, update: cst.BaseStatement) -> bool:
    """Whether forward reads the mask only as `scores.masked_fill(~attention_mask, ...)`, after the update and once
    a branch on its dtype is folded to its boolean arm (as `_Indexer` leaves it)."""
    body = list(fwd.body.body)
    i = body.index(update)
    kept = [x for s in body[i + 1 :] for x in (s.body.body if _on_dtype(s) else [s])]
    reads = sum(len(findall(x, m.Name(MASK))) for x in kept)
    masking = sum(len(findall(x, MASKED_FILL)) for x in kept)
    before = sum(len(findall(x, m.Name(MASK))) for x in body[:i])
    return before == 0 and 0 < masking == reads


def _masks_by_position(fwd: cst.FunctionDef, update: cst.BaseStatement) -> bool:
    """Whether forward, reading no mask, masks its scores after the update with a comparison against its
    parameter `position_ids` (`scores.masked_fill(k_positions > position_ids[..., None], ...)`, or through a name
    bound to one)."""
    if POSITIONS not in param_names(fwd) or findall(fwd.body, m.Name(MASK)):
        return False

    def on_positions(e: cst.BaseExpression) -> bool:
        return isinstance(e, cst.Comparison) and POSITIONS in free_names(e)

    body = list(fwd.body.body)
    bound = [a for s in body for a in findall(s, m.Assign([m.AssignTarget(m.Name())]))]
    tests = {a.targets[0].target.value for a in bound if on_positions(a.value)}
    conditions = [
        c.args[0].value for s in body[body.index(update) + 1 :] for c in findall(s, ANY_MASKED_FILL)
    ]
    return any(on_positions(c) or (isinstance(c, cst.Name) and c.value in tests) for c in conditions)


def _picking(attrs: Collection[str]) -> m.BaseMatcherNode:
    """`picks = self.<indexer>(...)`."""
    call = m.Call(func=m.Attribute(m.Name("self"), m.OneOf(*map(m.Name, attrs))))
    return m.Assign([m.AssignTarget(m.Name())], call)


def _on_dtype(s: cst.BaseStatement) -> bool:
    return isinstance(s, cst.If) and m.matches(s.test, BOOL_DTYPE)


def _per_request(fn: cst.FunctionDef) -> list[cst.BaseStatement]:
    """`x = by_request(x, forward_metadata)` for each input the runtime does not fold away (positions where the
    forward reads them)."""
    reads_positions = bool(findall(fn.body, m.Name(POSITIONS)))
    kept = [
        p
        for p in param_names(fn)[1:]
        if p not in HF_ONLY and p != "kwargs" and (p != POSITIONS or reads_positions)
    ]
    return [stmt(f"{p} = by_request({p}, forward_metadata)") for p in kept]


class _PassMetadata(Transformer):
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


def _mask_arm(s: cst.BaseStatement, picks: set[str]) -> bool:
    """`if self.config._attn_implementation ...: attention_mask = <from the picks>`, with no else arm."""
    return (
        isinstance(s, cst.If)
        and s.orelse is None
        and m.matches(s.test, BY_IMPLEMENTATION)
        and all(assigned_names(x) == {MASK} for x in s.body.body)
        and bool(free_names(s.body) & picks)
    )


def _picks_passed_otherwise(call: cst.Call, picks: set[str]) -> list[cst.Arg]:
    """The arguments of an attention call that pass an indexer's picks under a keyword other than `indices=`
    (`block_indices=picks`), where it passes none as `indices=`."""
    if called_name(call) not in INTERFACE or kwarg(call, "indices"):
        return []
    return [a for a in call.args if a.keyword and m.matches(a.value, m.Name()) and a.value.value in picks]


class _PicksAsIndices(Transformer):
    """The attention call passing an indexer's picks under another keyword (`block_indices=picks`) passes them as
    `indices=`, with the size of the blocks they number as `index_block=` where they do."""

    def __init__(self, picks: set[str], block: str | None):
        self.picks, self.block = picks, block

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        renamed = {id(a) for a in _picks_passed_otherwise(updated, self.picks)}
        if not renamed:
            return updated
        args = [a.with_changes(keyword=cst.Name("indices")) if id(a) in renamed else a for a in updated.args]
        updated = updated.with_changes(args=args)
        return appended(updated, "index_block", self.block) if self.block else updated


class _HandOverPicks(Transformer):
    """`if self.config._attn_implementation ...: <mask from the picks> else: indices = picks` -> the else arm,
    without a `indices = None` right before it that the arm overwrites; with no else arm, nothing."""

    def __init__(self, indices: set[str], picks: set[str]):
        self.indices, self.picks = indices, picks

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
            if _mask_arm(s, self.picks | self.indices):
                continue
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
        built = {name: cls for name, cls in classes(module).items() if name in indexers}
        module = rewrite_classes(module, lambda cls: self._hand_over(cls, built))
        self.add_needed_imports(
            [
                ("runtime.layers.index_cache", "IndexKeyCache"),
                ("runtime.layers.index_cache", "by_request"),
                ("runtime.engine.forward_metadata", "ForwardMetaData"),
            ]
        )
        return module

    def _indexer(self, name: str, cls: cst.ClassDef) -> cst.ClassDef | None:
        updating = [fn for fn in findall(cls.body, m.FunctionDef()) if findall(fn, UPDATE)]
        if not updating:
            return None
        fwd, init = method(cls, "forward"), method(cls, "__init__")
        found = _update_line(fwd) if updating == [fwd] else None
        by_position = found is not None and _masks_by_position(fwd, found[0])
        why = (
            "outside its forward, or not as `k = cache.update_indexer(k, ...)` at the forward's top level"
            if found is None
            else "it masks its scores neither with `attention_mask` (as `scores.masked_fill(~attention_mask, "
            "...)` after the update, the mask read nowhere else) nor by `position_ids`, so it could pick other "
            "requests' keys"
            if not (by_position or _masks_only(fwd, found[0]))
            else "no `self.head_dim` in `__init__` gives its keys' width"
            if init is None or not findall(init, HEAD_DIM)
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
        new_fwd = with_forward_metadata(
            fwd.with_changes(body=fwd.body.visit(_Indexer(update, key, by_position)))
        )
        body = list(new_fwd.body.body)
        first = 1 if body and is_docstring(body[0]) else 0
        new_fwd = new_fwd.with_changes(
            body=new_fwd.body.with_changes(body=[*body[:first], *_per_request(fwd), *body[first:]])
        )
        new_init = init.with_changes(body=init.body.with_changes(body=[*init.body.body, ctor]))
        swap = {id(fwd): new_fwd, id(init): new_init}
        return cls.with_changes(body=cls.body.with_changes(body=[swap.get(id(s), s) for s in cls.body.body]))

    def _hand_over(self, cls: cst.ClassDef, indexers: dict[str, cst.ClassDef]) -> cst.ClassDef | None:
        """A class holding an indexer (`self.X = Indexer(...)`, or `None if ... else Indexer(...)`): its calls
        pass forward_metadata on, and it hands the picks over as `indices=`; None for other classes."""
        init = method(cls, "__init__")
        held = instance_attrs(init, set(indexers)) if init else {}
        attrs = {a: indexers[c] for a, (c, is_list) in held.items() if not is_list}
        if not attrs:
            return None
        picks = set().union(*(assigned_names(a) for a in findall(cls, _picking(attrs))))
        arms = [s for s in findall(cls, m.If()) if _mask_arm(s, picks)]
        block, why = _block_size(arms, attrs, init)
        renamed = [a for c in findall(cls, m.Call(func=m.Name())) for a in _picks_passed_otherwise(c, picks)]
        if renamed and arms and block is None and not why:
            why = (
                f"passed as `{renamed[0].keyword.value}=`, with a mask the rule cannot read: neither positions "
                "nor blocks expanded with `repeat_interleave(self.<size>, dim=-1)` by the indexer's own method"
            )
        if why:
            self.rewrite.unsupported(cls.name.value, 0, f"a sparse-attention indexer's picks {why}")
            return None
        cls = cls.visit(_PassMetadata(set(attrs))).visit(_PicksAsIndices(picks, block))
        indices = {a.value.value for a in findall(cls, m.Arg(m.Name(), keyword=m.Name("indices")))}
        return cls.visit(_HandOverPicks(indices, picks)) if indices else cls


def _block_size(
    arms: list[cst.If], attrs: dict[str, cst.ClassDef], holder: cst.FunctionDef
) -> tuple[str | None, str | None]:
    """(what sets the size of the blocks an indexer's picks number, or why the rule cannot tell): read off the
    mask a dropped arm builds with the indexer's own method (`self.indexer.build_block_mask(...)` expanding its
    verdicts with `repeat_interleave(self.block_size, dim=-1)`, `self.block_size = config.index_block_size`, the
    config the holder's `__init__` builds the indexer with); (None, None) for picks of positions."""
    for call in (c for arm in arms for c in findall(arm, m.Call(func=m.Attribute(_SELF_ATTR)))):
        attr = call.func.value.attr.value
        indexer = attrs.get(attr)
        builder = indexer and method(indexer, call.func.attr.value)
        for expand in findall(builder, BLOCKS_TO_KEYS) if builder else ():
            size = expand.args[0].value.attr.value
            init = method(indexer, "__init__")
            sets = findall(init, m.Assign([m.AssignTarget(m.Attribute(m.Name("self"), m.Name(size)))]))
            if (
                len(sets) == 1
                and free_names(sets[0].value) <= {"config"}
                and _given_own_config(holder, attr, indexer.name.value, init)
            ):
                return code(sets[0].value), None
            return None, (
                f"number blocks of `self.{size}` keys, which the indexer's `__init__` does not set once from the "
                "config its holder builds it with"
            )
    return None, None


def _given_own_config(holder: cst.FunctionDef, attr: str, indexer: str, init: cst.FunctionDef) -> bool:
    """Whether holder (an `__init__` taking `config`) builds `self.<attr> = indexer(...)` with that config as the
    indexer's `config` (init: the indexer's `__init__`)."""
    param = next((p for p in named_params(init) if p.name.value == "config"), None)
    if param is None or "config" not in param_names(holder):
        return False
    built = findall(holder, m.Assign([m.AssignTarget(m.Attribute(m.Name("self"), m.Name(attr)))]))
    calls = [c for a in built for c in findall(a.value, m.Call(func=m.Name(indexer)))]
    return bool(calls) and all(m.matches(binding(c, init, param), m.Arg(m.Name("config"))) for c in calls)
