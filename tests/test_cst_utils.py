"""cst_utils.findall against libcst's own findall: the same nodes, in the same order, for every kind of matcher;
cst_utils.walk against node.visit: the same calls in the same order; cst_utils.Transformer against a full walk:
the same code, with the subtrees it has nothing to do in left as they were."""

import inspect
import textwrap

import libcst as cst
import libcst.matchers as m
import pytest
from transformers.models.llama import modeling_llama

from skills.migrator.cst_utils import Transformer, findall, walk, with_forward_metadata

MATCHERS = {
    "name": m.Name(),
    "name_self": m.Name("self"),
    "view_call": m.Call(func=m.Attribute(attr=m.Name("view") | m.Name("reshape"))),
    "one_of": m.Name() | m.Attribute(),
    "self_assign": m.Assign([m.AssignTarget(m.Attribute(m.Name("self")))]),
    "predicate": m.MatchIfTrue(lambda n: isinstance(n, cst.Integer)),
    "not_a_name": m.DoesNotMatch(m.Name()),
    "all_of": m.AllOf(m.Call(), m.Call(func=m.Name())),
    "type_of": m.TypeOf(m.If, m.For),
}


@pytest.fixture(scope="module")
def module() -> cst.Module:
    return cst.parse_module(inspect.getsource(modeling_llama))


@pytest.mark.parametrize("kind", MATCHERS)
def test_the_same_nodes_in_the_same_order(module, kind):
    matcher = MATCHERS[kind]
    ours = findall(module, matcher)
    assert ours and [id(n) for n in ours] == [id(n) for n in m.findall(module, matcher)]
    attention = next(c for c in findall(module, m.ClassDef()) if c.name.value == "LlamaAttention")
    assert [id(n) for n in findall(attention, matcher)] == [id(n) for n in m.findall(attention, matcher)]


def test_sentinels_hold_nothing():
    assert findall(cst.MaybeSentinel.DEFAULT, m.Name()) == []


class _Recorder(cst.CSTVisitor):
    """Every visit and leave, in order; does not enter lambdas (a visit_* returning False)."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        self.calls.append(("visit", id(node)))
        return super().on_visit(node)

    def on_leave(self, node: cst.CSTNode) -> None:
        self.calls.append(("leave", id(node)))
        super().on_leave(node)

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False


def test_walk_makes_the_calls_visit_makes(module):
    walked, visited = _Recorder(), _Recorder()
    walk(walked, module)
    module.visit(visited)
    assert len(walked.calls) > 10_000 and walked.calls == visited.calls


class _Rename:
    """view -> reshape in attribute names, and the depth of FunctionDefs seen (state kept across hooks)."""

    def __init__(self):
        self.depth = self.deepest = 0

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.depth += 1
        self.deepest = max(self.deepest, self.depth)

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        self.depth -= 1
        return updated

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.Attribute:
        return updated.with_changes(attr=cst.Name("reshape")) if updated.attr.value == "view" else updated


class _Skipping(_Rename, Transformer):
    pass


class _Walking(_Rename, cst.CSTTransformer):
    pass


class _WithGenericHook(_Skipping):
    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode) -> cst.CSTNode:
        return super().on_leave(original, updated)


def test_transformer_skips_only_subtrees_it_has_nothing_to_do_in(module):
    skipping, walking = _Skipping(), _Walking()
    got, want = module.visit(skipping), module.visit(walking)
    assert got.code == want.code and "view(" not in got.code and skipping.deepest == walking.deepest
    untouched = [s for s in module.body if not findall(s, m.Attribute() | m.FunctionDef())]
    assert untouched and all(any(s is t for t in got.body) for s in untouched)  # not rebuilt
    rebuilt = module.visit(_WithGenericHook())  # a generic hook may act anywhere: nothing is skipped
    assert rebuilt.code == want.code and not any(s is t for s in untouched for t in rebuilt.body)


def test_layers_looped_over_get_forward_metadata_where_kwargs_held_it():
    """with_forward_metadata: the model's layers, called as `self.<attr>(...)` or through a loop over them (the
    list, a slice of it, or `enumerate` of either; Inkling2-Loop's passes), get forward_metadata by name beside
    `**kwargs`; a function that is not a layer does not, and a second application changes nothing."""
    before = textwrap.dedent(
        """
        def forward(self, hidden_states, **kwargs):
            hidden_states = self.embed(hidden_states, **kwargs)
            for layer in self.layers[: self.start]:
                hidden_states = layer(hidden_states, **kwargs)
            for i, layer in enumerate(self.layers[self.start :]):
                hidden_states = layer(hidden_states, i, **kwargs)
            for block in self.blocks:
                hidden_states = block(hidden_states, **kwargs)
            return helper(hidden_states, **kwargs)
        """
    )
    after = textwrap.dedent(
        """
        def forward(self, hidden_states, *, forward_metadata: ForwardMetaData, **kwargs):
            hidden_states = self.embed(hidden_states, forward_metadata=forward_metadata, **kwargs)
            for layer in self.layers[: self.start]:
                hidden_states = layer(hidden_states, forward_metadata=forward_metadata, **kwargs)
            for i, layer in enumerate(self.layers[self.start :]):
                hidden_states = layer(hidden_states, i, forward_metadata=forward_metadata, **kwargs)
            for block in self.blocks:
                hidden_states = block(hidden_states, forward_metadata=forward_metadata, **kwargs)
            return helper(hidden_states, **kwargs)
        """
    )
    fn = cst.parse_module(before).body[0]
    once = with_forward_metadata(fn)
    assert cst.Module([once]).code == after.lstrip()
    assert with_forward_metadata(once).deep_equals(once)
