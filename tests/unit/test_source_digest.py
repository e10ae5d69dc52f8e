# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The fingerprints depend on the code alone: the AST changes Python 3.12 and 3.13 made (and 3.14-style ones) do not
move a digest, while any change of the code does; an interpreter that reads code otherwise is named as the unknown.

The real interpreters are run in ``tests/release/test_pythons.py``; here the same changes are made to the trees of one
interpreter ("frozen" trees), so the default suite proves the rules wherever it runs.
"""

import ast
import copy
import inspect
import sys

import pytest

from deepspeed_offload_patch import guard, source_digest
from deepspeed_offload_patch.changes import CHANGES, UPSTREAM
from deepspeed_offload_patch.changes.overflow_flag import methods as overflow
from deepspeed_offload_patch.fingerprints import OWN

SOURCE = inspect.getsource(overflow.update_offload_overflow_tracker)


def _tree():
    return ast.parse(SOURCE).body[0]


def _as_312(tree):
    """What 3.12 adds: an empty ``type_params`` on every function (and class)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            node._fields = tuple(
                node._fields) + ("type_params", ) if "type_params" not in node._fields else node._fields
            node.type_params = []
    return tree


def _with_new_empty_fields(tree):
    """A future Python that gives every node a new field with an empty default."""
    for node in ast.walk(tree):
        node._fields = tuple(node._fields) + ("added_later", "added_list")
        node.added_later = None
        node.added_list = []
    return tree


def _reordered(tree):
    """The same fields, listed in the reverse order."""
    for node in ast.walk(tree):
        node._fields = tuple(reversed(node._fields))
    return tree


def _dump(tree) -> str:
    """``ast.dump`` with every field shown (3.13 leaves empty ones out by default, which would hide the change)."""
    return ast.dump(tree, **({"show_empty": True} if sys.version_info >= (3, 13) else {}))


@pytest.mark.parametrize("change", [_as_312, _with_new_empty_fields, _reordered])
def test_interpreter_changes_do_not_move_the_digest(change):
    before, after = _tree(), change(_tree())
    assert source_digest.canonical(after) == source_digest.canonical(before)


# On 3.12 and later every function's tree has type_params already: that change is this interpreter's own there.
FOREIGN_CHANGES = [_with_new_empty_fields, _reordered
                   ] + ([] if "type_params" in ast.FunctionDef._fields else [_as_312])


@pytest.mark.parametrize("change", FOREIGN_CHANGES)
def test_ast_dump_which_the_fingerprints_once_hashed_moves_with_them(change):
    assert _dump(change(_tree())) != _dump(_tree())


def test_ast_dump_display_options_are_not_read():
    tree = _tree()
    assert source_digest.canonical(tree) == source_digest.canonical(copy.deepcopy(tree))
    assert "type_params" not in source_digest.canonical(_as_312(_tree()))
    assert "ctx" not in source_digest.canonical(tree) and "lineno" not in source_digest.canonical(tree)


@pytest.mark.parametrize(
    "a, b",
    [
        ("if f(x):\n    y = 1\n", "if f(x).any():\n    y = 1\n"),  # a check that reads the host, and one that does not
        ("return\n", "return None\n"),  # an empty value is not a None constant
        ("x = 1\n", "x = True\n"),  # constants keep their type
        ("x = [a]\n", "x = (a, )\n"),
        ("x = a\n", "a = x\n"),  # Store and Load are told apart by position, not ctx
        ("del a[0]\n", "a[0]\n"),
        ("x = f'{a!r}'\n", "x = f'{a}'\n"),
    ])
def test_any_change_of_the_code_moves_the_digest(a, b):

    def as_function(body):
        return "def f(self, a):\n" + "".join("    " + line + "\n" for line in body.splitlines())

    assert source_digest.digest_source(as_function(a)) != source_digest.digest_source(as_function(b))


def test_module_digests_are_the_digests_of_each_function():
    digests = source_digest.module_digests(overflow.__file__)
    assert digests["update_offload_overflow_tracker"] == source_digest.digest_source(SOURCE)
    # The recorded ones, on this interpreter.
    assert {key: digest for change in CHANGES for key, digest in guard.own_digests(change).items()} == OWN


def test_an_interpreter_that_reads_code_otherwise_is_named_not_deepspeed(monkeypatch):
    """Every digest moves (DeepSpeed's and the package's own): status blames the interpreter and patches nothing."""
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from deepspeed_offload_patch import patcher
    # DeepSpeed's own methods (this process may have patched the class): a class of them in DeepSpeed's module.
    originals = {
        name: patcher.originals().get(name, DeepSpeedZeroOptimizer.__dict__[name])
        for name in UPSTREAM.form_for(DeepSpeedZeroOptimizer).methods
    }
    cls = type("DeepSpeedZeroOptimizer", (), dict(originals, __module__=DeepSpeedZeroOptimizer.__module__))
    assert guard.decide_by_methods(UPSTREAM, cls, deepspeed.__version__).state == "applied"
    assert guard.interpreter_problem(UPSTREAM) is None
    real = source_digest._digest
    monkeypatch.setattr(source_digest, "_digest", lambda node: real(node)[::-1])
    problem = guard.interpreter_problem(UPSTREAM)
    assert problem and "the interpreter, not DeepSpeed, is what is unknown" in problem
    decision = guard.decide_by_methods(UPSTREAM, cls, deepspeed.__version__)
    assert decision.state == "unsupported" and decision.replacements == {}
    assert "Python" in decision.reason and "the interpreter, not DeepSpeed" in decision.reason, decision.reason
    assert "mismatch" in decision.reason


def test_source_that_is_not_a_function_has_no_fingerprint():
    """A function compiled from a string under a file's name reads that file's first lines as its source."""
    with pytest.raises(ValueError):
        source_digest.digest_source("import os\n")
    namespace = {}
    exec(compile("def f(self):\n    return 1\n", overflow.__file__, "exec"), namespace)
    assert guard.fingerprint(namespace["f"]) is None
