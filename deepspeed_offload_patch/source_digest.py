# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""A digest of one function's code that is a function of the code alone, not of the interpreter that parses it.

``ast.dump`` is a display format and changes between Pythons: 3.12 writes ``type_params=[]`` into every function,
3.13 leaves out empty lists and ``None`` fields. A digest of its text is therefore a digest of the interpreter too.
:func:`canonical` writes the tree in a form of its own instead, with four rules:

- a node is its class name and its fields, **sorted by field name** (the order of ``_fields`` is not relied on);
- a field whose value is empty (``None`` or ``[]``) is **left out**, so a field a new Python adds with an empty
  default (``type_params`` in 3.12) writes nothing; only a field that carries code writes anything;
- ``ctx`` (Load/Store/Del, implied by where the node stands) and the position attributes are not written;
- a constant is its type name and ``repr`` (``int:1`` and ``bool:True`` stay apart).

What is left is what the source says: the node types and their non-empty fields. A Python that only adds fields with
empty defaults, reorders fields or changes ``ast.dump`` cannot move a digest. One that renames a node or a field, or
parses the same code into another tree, can; :data:`deepspeed_offload_patch.fingerprints.OWN` records the digests of
the package's own replacements so that the guard can tell such an interpreter from a changed DeepSpeed.

This module imports only the standard library, so any interpreter can load it by path (``ci/pythons.py`` does).
"""

import ast
import hashlib
import textwrap
from typing import Dict, List

#: Fields that are never written: implied by the tree (``ctx``) or not code (``type_comment``, only with
#: ``type_comments=True``).
SKIPPED_FIELDS = frozenset({"ctx", "type_comment"})


def _empty(value: object) -> bool:
    return value is None or (isinstance(value, list) and not value)


def _write(value: object, out: List[str]) -> None:
    if isinstance(value, ast.AST):
        out.append(type(value).__name__)
        out.append("(")
        for name in sorted(value._fields):
            if name in SKIPPED_FIELDS:
                continue
            field = getattr(value, name, None)
            # A constant's value is code even when it is None (``return None`` is not ``return``).
            if _empty(field) and not (isinstance(value, ast.Constant) and name == "value"):
                continue
            out.append(name)
            out.append("=")
            _write(field, out)
            out.append(";")
        out.append(")")
    elif isinstance(value, list):
        out.append("[")
        for item in value:
            _write(item, out)
            out.append(",")
        out.append("]")
    else:
        out.append(f"{type(value).__name__}:{value!r}")


def canonical(node: ast.AST) -> str:
    """The interpreter-independent text of ``node`` (the rules are in the module's docstring)."""
    out: List[str] = []
    _write(node, out)
    return "".join(out)


def _without_what_is_ignored(node: ast.AST) -> ast.AST:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        # Source that is not a function's: a function compiled from a string under a file's name reads that
        # file's first lines.
        raise ValueError(f"not a function definition: {type(node).__name__}")
    node.name = ""
    node.decorator_list = []
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        node.body = node.body[1:] or [ast.Pass()]
    return node


def _digest(node: ast.AST) -> str:
    return hashlib.sha256(canonical(_without_what_is_ignored(node)).encode()).hexdigest()[:16]


def digest_source(source: str) -> str:
    """16 hex digits of SHA-256 over :func:`canonical` of the first statement of ``source`` (a function, possibly
    indented as a method) without its name, its decorators and its docstring (a body of only a docstring counts as
    ``pass``): blind to formatting, comments, decorators, the docstring, the function's name and the interpreter.

    Raises ``SyntaxError`` when ``source`` does not parse, ``IndexError`` when it holds no statement and
    ``ValueError`` when its first statement is no function."""
    return _digest(ast.parse(textwrap.dedent(source)).body[0])


def module_digests(path: str) -> Dict[str, str]:
    """``{name: digest}`` of the functions defined at the top level of the Python file ``path`` (the same digest as
    :func:`digest_source` of each one's text). Raises ``OSError`` when the file cannot be read."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    names = [node.name for node in functions]  # before _digest blanks them
    return dict(zip(names, map(_digest, functions)))
