# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Decides whether the loaded DeepSpeed may be patched: version range, fingerprints, conflicts.

Nothing here changes DeepSpeed. :func:`inspect_target` looks at the class that defines the two methods and returns
a :class:`Decision` (the state to report, and which replacement goes with each method); the patcher acts on it.
"""

import ast
import hashlib
import importlib
import inspect
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from deepspeed_offload_patch.fingerprints import UNFIXED
from deepspeed_offload_patch.releases import PATCHED_RELEASES

#: The releases the replacements were checked against. Compared on the release part of the version, so a local build
#: of a release (``0.19.8+abc``) counts as that release.
SUPPORTED = SpecifierSet(f">={PATCHED_RELEASES[0]},<={PATCHED_RELEASES[-1]}")


@dataclass(frozen=True)
class PatchSet:
    """Methods of ``DeepSpeedZeroOptimizer`` that are replaced together, and the module of their replacements."""

    name: str
    module: str
    methods: Tuple[str, ...]


#: The fix itself (DeepSpeed pull request 8963), applied by default.
OVERFLOW_FLAG = PatchSet("overflow-flag", "deepspeed_offload_patch.overflow",
                         ("update_offload_overflow_tracker", "has_overflow"))
#: Opt-in: the offload gradient norm summed on the device.
GRAD_NORM = PatchSet("grad-norm-on-device", "deepspeed_offload_patch.grad_norm",
                     ("complete_grad_norm_calculation_for_cpu_offload", ))
PATCH_SETS = (OVERFLOW_FLAG, GRAD_NORM)

#: The methods the default patch replaces.
METHODS = OVERFLOW_FLAG.methods
#: Every method some patch set replaces (the fingerprint table covers them all).
ALL_METHODS = tuple(name for patch_set in PATCH_SETS for name in patch_set.methods)

# Per-method findings, reported by status().
PATCHABLE = "patchable"  # DeepSpeed's own unfixed code, in a form with a known fingerprint
FIXED = "fixed"  # already the fixed form
MISMATCH = "mismatch"  # DeepSpeed's own code, in a form this package does not know
FOREIGN = "foreign"  # replaced by someone else
OURS = "ours"  # already replaced by this package
MISSING = "missing"  # not defined on the class


def fingerprint_source(source: str) -> str:
    """Digest of one function's source, blind to formatting, comments, decorators, docstring and its name."""
    node = ast.parse(textwrap.dedent(source)).body[0]
    node.name = ""
    node.decorator_list = []
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        node.body = node.body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(node, include_attributes=False).encode()).hexdigest()[:16]


def fingerprint(func: Callable) -> Optional[str]:
    """:func:`fingerprint_source` of ``func``, or None when its source cannot be read (no ``.py`` file)."""
    try:
        return fingerprint_source(inspect.getsource(func))
    except (OSError, TypeError, SyntaxError, IndexError):
        return None


def replacements(name: str) -> Tuple[Tuple[str, Callable], ...]:
    """``((release range, function), ...)``: the replacements of method ``name`` (empty for a method the package
    does not replace)."""
    for patch_set in PATCH_SETS:
        if name in patch_set.methods:
            return importlib.import_module(patch_set.module).REPLACEMENTS[name]
    return ()


def replacement_for(name: str, digest: Optional[str]) -> Optional[Callable]:
    """The replacement for the unfixed form ``digest`` of method ``name``: the one whose declared range holds every
    release that ships that form. None when the form is not a known unfixed one."""
    releases = UNFIXED.get(name, {}).get(digest)
    if not releases:
        return None
    for spec, func in replacements(name):
        if all(SpecifierSet(spec).contains(v) for v in releases):
            return func
    return None


def release_of(version: str) -> Optional[Version]:
    """The release part of a version string (``0.19.8+abc`` gives 0.19.8), or None if it is not a version."""
    try:
        return Version(Version(version).base_version)
    except (InvalidVersion, TypeError):
        return None


def in_supported_range(version: str) -> bool:
    release = release_of(version)
    return release is not None and SUPPORTED.contains(release, prereleases=True)


def _defined_in(func: Callable, cls: type) -> bool:
    """True when ``func`` is a plain function compiled from the file of the module that defines ``cls``."""
    code = getattr(func, "__code__", None)
    module_file = getattr(sys.modules.get(cls.__module__), "__file__", None)
    if code is None or module_file is None or hasattr(func, "__wrapped__"):
        return False
    return code.co_filename == module_file and func.__qualname__ == f"{cls.__name__}.{func.__name__}"


def classify_method(cls: type, name: str) -> Tuple[str, Optional[Callable]]:
    """Classify ``cls.<name>``; for PATCHABLE, also return the replacement that goes with its form."""
    func = cls.__dict__.get(name)
    if func is None:
        return MISSING, None
    if any(func is ours for _, ours in replacements(name)):
        return OURS, None
    if not _defined_in(func, cls):
        return FOREIGN, None
    digest = fingerprint(func)
    if digest is not None and any(digest == fingerprint(ours) for _, ours in replacements(name)):
        return FIXED, None
    replacement = replacement_for(name, digest)
    return (PATCHABLE, replacement) if replacement is not None else (MISMATCH, None)


@dataclass
class Decision:
    """What the guard found: the state to report, why, each method's finding, and the replacements to install
    (only when the state is ``applied`` and the methods are not ours already)."""

    state: str
    reason: str
    methods: Dict[str, str] = field(default_factory=dict)
    replacements: Dict[str, Callable] = field(default_factory=dict)


def inspect_target(cls: type, version: str, patch_set: PatchSet = OVERFLOW_FLAG) -> Decision:
    """Decide what to do with ``patch_set``'s methods of ``cls`` (``DeepSpeedZeroOptimizer``) on DeepSpeed
    ``version``.

    Order matters: a class already fixed upstream is ``upstream-fixed`` whatever its version; a method that someone
    else replaced makes a ``conflict`` (never clobbered); then the version range and the fingerprints must agree.
    """
    found = {name: classify_method(cls, name) for name in patch_set.methods}
    methods = {name: result for name, (result, _) in found.items()}
    results = set(methods.values())
    if results == {OURS}:
        return Decision("applied", f"DeepSpeed {version}: already applied", methods)
    if results == {FIXED}:
        return Decision("upstream-fixed", f"DeepSpeed {version} already has the fixed form of {patch_set.name}",
                        methods)
    foreign = [name for name, result in methods.items() if result == FOREIGN]
    if foreign:
        owners = ", ".join(f"{name} (now {_owner(cls.__dict__[name])})" for name in foreign)
        return Decision("conflict", f"{cls.__name__} methods already replaced by another patch: {owners}", methods)
    if not in_supported_range(version):
        return Decision(
            "unsupported", f"DeepSpeed {version} is outside the supported releases "
            f"{PATCHED_RELEASES[0]} to {PATCHED_RELEASES[-1]}", methods)
    odd = [f"{name}: {result}" for name, result in methods.items() if result != PATCHABLE]
    if odd:
        return Decision(
            "unsupported", f"DeepSpeed {version}: {cls.__name__} is not the code this patch was built for "
            f"({', '.join(odd)})", methods)
    return Decision("applied", f"DeepSpeed {version}: the methods match a known unfixed form", methods, {
        name: replacement
        for name, (_, replacement) in found.items()
    })


def _owner(func: Callable) -> str:
    module = getattr(func, "__module__", None) or "?"
    qualname = getattr(func, "__qualname__", None) or type(func).__name__
    return f"{module}.{qualname}"
