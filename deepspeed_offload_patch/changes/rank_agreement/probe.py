# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The rank-agreement fix's probe: can ZeRO-1's ranks disagree about an overflow in a class in no known form?

It reads the code instead of running it: running ``has_overflow`` would put a tensor on the accelerator while
DeepSpeed's module is being imported, before a rank has chosen its device (a CUDA context on device 0 for every
rank)."""

import ast
import inspect
import textwrap
from typing import Optional

#: The method the fix replaces.
METHOD = "_check_overflow"


def _tree(cls: type, name: str) -> Optional[ast.AST]:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, name))))
    except (AttributeError, OSError, TypeError, SyntaxError):
        return None


def _names(node: ast.AST) -> set:
    return {n.id
            for n in ast.walk(node)
            if isinstance(n, ast.Name)} | {n.attr
                                           for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def probe_agreement(cls: type) -> Optional[str]:
    """None when ``cls``'s ranks agree about an overflow at ZeRO-1: ``step()`` does not pass ``partition_gradients``
    to ``check_overflow``, or ``has_overflow`` does not make its all-reduce depend on it. Else what the code does;
    code that cannot be read counts as not known to agree."""
    step, has_overflow = _tree(cls, "step"), _tree(cls, "has_overflow")
    if step is None or has_overflow is None:
        return "has a step() or has_overflow whose source cannot be read"
    passes = any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "check_overflow" and
        (node.args or any(keyword.arg == "partition_gradients" for keyword in node.keywords))
        for node in ast.walk(step))
    gated = any(
        isinstance(node, ast.If) and "partition_gradients" in _names(node.test)
        and "all_reduce" in _names(ast.Module(body=node.body, type_ignores=[])) for node in ast.walk(has_overflow))
    if passes and gated:
        return ("all-reduces the overflow flag over the data parallel ranks only when step() says the gradients are "
                "partitioned (ZeRO-2): at ZeRO-1 the ranks can disagree")
    return None
