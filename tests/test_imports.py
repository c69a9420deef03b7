"""skills/migrator/imports.py: what a name or attribute chain names, read from the file's imports, spelled as
LibCST's QualifiedNameProvider spells it (the rules compare against those spellings)."""

from textwrap import dedent

import libcst as cst
from libcst.metadata import MetadataWrapper, QualifiedNameProvider

from skills.migrator.imports import import_bindings, qualified_names

SOURCE = dedent("""\
    import torch
    import torch.nn.functional as F
    import numpy.linalg
    from torch import nn as tnn
    from ...modeling_utils import PreTrainedModel
    from . import configuration_x
    from .helpers import *
    try:
        from flash_attn import flash_fn
    except ImportError:
        from .fallback import flash_fn

    def f(x):
        from transformers.utils import auto_docstring
        return (
            torch.nn.Dropout, F.dropout, numpy.linalg.norm, tnn.Linear, PreTrainedModel,
            configuration_x.XConfig, flash_fn, auto_docstring, x.shape, len, (x + 1).real,
        )
    """)


def _read_expressions(module: cst.Module) -> list[cst.BaseExpression]:
    function = module.body[-1]
    return [element.value for element in function.body.body[-1].body[0].value.elements]


def test_names_follow_the_imports_and_keep_relative_dots():
    module = cst.parse_module(SOURCE)
    bindings = import_bindings(module)
    assert [qualified_names(e, bindings) for e in _read_expressions(module)] == [
        {"torch.nn.Dropout"},
        {"torch.nn.functional.dropout"},
        {"numpy.linalg.norm"},
        {"torch.nn.Linear"},
        {"...modeling_utils.PreTrainedModel"},
        {".configuration_x.XConfig"},
        {"flash_attn.flash_fn", ".fallback.flash_fn"},
        {"transformers.utils.auto_docstring"},
        set(),  # a parameter's attribute
        set(),  # a builtin
        set(),  # not a name or attribute chain
    ]


def test_imported_names_agree_with_libcsts_provider():
    wrapper = MetadataWrapper(cst.parse_module(SOURCE))
    provided = wrapper.resolve(QualifiedNameProvider)
    bindings = import_bindings(wrapper.module)
    for expression in _read_expressions(wrapper.module)[:8]:
        assert qualified_names(expression, bindings) == {q.name for q in provided[expression]()}  # lazy
