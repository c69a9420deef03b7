"""cst_utils.findall against libcst's own findall: the same nodes, in the same order, for every kind of matcher."""

import inspect

import libcst as cst
import libcst.matchers as m
import pytest
from transformers.models.llama import modeling_llama

from skills.migrator.cst_utils import findall

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
