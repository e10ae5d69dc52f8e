# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Decides whether a change may be applied to the loaded DeepSpeed: version range, fingerprints, conflicts.

Nothing here changes DeepSpeed, and nothing here knows a change by name: each function is given the
:class:`~deepspeed_offload_patch.changes.record.Change` it decides on. :func:`decide_by_methods` looks at the class
that defines the change's methods and returns a :class:`Decision` (the state to report, and which replacement goes
with each method); the patcher acts on it. A change with more to weigh decides in its own module, with the helpers
here.
"""

import importlib.util
import inspect
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from deepspeed_offload_patch.changes.record import Change
from deepspeed_offload_patch.fingerprints import OWN, UNFIXED
from deepspeed_offload_patch.releases import PATCHED_RELEASES
from deepspeed_offload_patch.source_digest import digest_source, module_digests
from deepspeed_offload_patch.states import State

#: The releases the replacements were checked against (every release between the two ends). Compared on the release
#: part of the version, so a local build of a release (``0.19.8+abc``) counts as that release.
FIRST, LAST = PATCHED_RELEASES[0], PATCHED_RELEASES[-1]
#: The interpreters whose reading of the code the fingerprints were checked on (``ci/pythons.py``; README).
PYTHONS_TESTED = "3.10 - 3.13"
#: Why the line falls at ``FIRST``: said in the reason when an older DeepSpeed is found.
OLDER_REASON = ("releases before 0.14.0 do not import with a current torch, their CPU accelerator needs Intel's "
                "extension and oneCCL bindings, so they are untested; before 0.13.3 the overflow check itself reads "
                "the host, which this fix does not change")

# Per-method findings, reported by status().
PATCHABLE = "patchable"  # DeepSpeed's own unfixed code, in a form with a known fingerprint
FIXED = "fixed"  # already the fixed form
MISMATCH = "mismatch"  # DeepSpeed's own code, in a form this package does not know
FOREIGN = "foreign"  # replaced by someone else
OURS = "ours"  # already replaced by this package
MISSING = "missing"  # not defined on the class
_CHANGES_PACKAGE = "deepspeed_offload_patch.changes."


def fingerprint_source(source: str) -> str:
    """Digest of one function's source, blind to formatting, comments, decorators, docstring, its name and the
    interpreter (:func:`deepspeed_offload_patch.source_digest.digest_source`)."""
    return digest_source(source)


def unwrapped(func: Any) -> Any:
    """The method under DeepSpeed's ``instrument_w_nvtx`` decorator (its ``wrapped_fn`` closes over the decorated
    function and copies none of its attributes), or ``func`` itself when it is not so wrapped."""
    if getattr(func, "__qualname__", "").endswith("instrument_w_nvtx.<locals>.wrapped_fn"):
        cells = dict(zip(func.__code__.co_freevars, func.__closure__ or ()))
        inner = cells.get("func")
        if inner is not None and callable(inner.cell_contents):
            return inner.cell_contents
    return func


def fingerprint(func: Callable) -> Optional[str]:
    """:func:`fingerprint_source` of ``func`` (of the method under DeepSpeed's NVTX wrapper, :func:`unwrapped`), or
    None when its source cannot be read (no ``.py`` file)."""
    try:
        return fingerprint_source(inspect.getsource(unwrapped(func)))
    except (OSError, TypeError, SyntaxError, IndexError, ValueError):
        return None


def own_digests(change: Change) -> Dict[str, str]:
    """``{"change.function": digest}`` of the top-level functions of ``change``'s replacements module (``methods``
    beside its record), read from its file on this interpreter without importing it (it imports DeepSpeed): what
    ``ci/gen_fingerprints.py`` records in :data:`fingerprints.OWN`."""
    spec = importlib.util.find_spec(f"{change.methods.__module__}.methods")
    path = spec.origin if spec else None
    return {
        f"{change.name}.{name}": digest
        for name, digest in (module_digests(path) if path and os.path.exists(path) else {}).items()
    }


def interpreter_problem(change: Change) -> Optional[str]:
    """None when this interpreter digests ``change``'s own replacements as recorded; else a sentence that names the
    interpreter. A Python that parses code into another tree moves every digest, DeepSpeed's included: then an
    unknown fingerprint says nothing about DeepSpeed."""
    prefix = f"{change.name}."
    try:
        here = own_digests(change)
    except (OSError, SyntaxError, ValueError) as exc:
        here = {"error": f"{type(exc).__name__}: {exc}"}
    moved = sorted(name for name in OWN if name.startswith(prefix) and here.get(name) != OWN[name])
    if not moved:
        return None
    return (f"Python {platform.python_version()} reads code differently from the interpreters this package was "
            f"built on (Python {PYTHONS_TESTED}): the fingerprints of the package's own replacements differ "
            f"({', '.join(moved)}), so the interpreter, not DeepSpeed, is what is unknown; use one of those Pythons "
            "or a release of this package that supports this one")


def replacement_for(change: Change, name: str, digest: Optional[str]) -> Optional[Callable]:
    """``change``'s replacement for the unfixed form ``digest`` of method ``name``: the one whose forms' releases hold
    every release that ships that form. None when the form is not a known unfixed one."""
    releases = UNFIXED.get(change.key(name), {}).get(digest)
    if not releases:
        return None
    ranges: Dict[Callable, list] = {}
    for spec, func in change.replacements(name):
        ranges.setdefault(func, []).append(SpecifierSet(spec))
    for func, specs in ranges.items():
        if all(any(spec.contains(v) for spec in specs) for v in releases):
            return func
    return None


def releases_shipping(functions: Dict[str, Optional[Callable]]) -> Tuple[str, ...]:
    """The releases that ship every one of these forms: for each ``method key: function`` (the key is
    :meth:`~deepspeed_offload_patch.changes.record.Target.key`'s: the bare name for ZeRO-1/2), the releases whose
    method has that function's form (its fingerprint in :data:`UNFIXED`), intersected, in release order. Empty when
    no release ships them all, or a function is None, has no readable source or is a form no release shipped."""
    shipped = [
        UNFIXED.get(name, {}).get(fingerprint(func) if func is not None else None, ())
        for name, func in functions.items()
    ]
    if not shipped:
        return ()
    return tuple(v for v in shipped[0] if all(v in releases for releases in shipped[1:]))


def release_of(version: str) -> Optional[Version]:
    """The release part of a version string (``0.19.8+abc`` gives 0.19.8), or None if it is not a version."""
    try:
        return Version(Version(version).base_version)
    except (InvalidVersion, TypeError):
        return None


def newer_than_tested(version: str) -> bool:
    """Whether ``version`` is past the last release tested: a later release, or a dev or local build of one."""
    release = release_of(version)
    return release is not None and release > Version(LAST)


def _defined_in(func: Callable, cls: type) -> bool:
    """True when ``func`` is a plain function compiled from the file of the module that defines ``cls``."""
    code = getattr(func, "__code__", None)
    module_file = getattr(sys.modules.get(cls.__module__), "__file__", None)
    if code is None or module_file is None or hasattr(func, "__wrapped__"):
        return False
    return code.co_filename == module_file and func.__qualname__ == f"{cls.__name__}.{func.__name__}"


def _under_other_change(change: Change, cls: type, name: str, func: Callable) -> Callable:
    """DeepSpeed's own method where ``func`` is another change's replacement of it, applied in this process (two
    changes replace one method, each on its own releases: the other's decision is about DeepSpeed's code, not about
    the package's); else ``func``. Reads the patcher only if it is loaded: deciding never imports it."""
    if not getattr(func, "__module__", "").startswith(_CHANGES_PACKAGE):
        return func
    patcher = sys.modules.get("deepspeed_offload_patch.patcher")
    original = patcher.originals().get(change.key(name)) if patcher is not None else None
    return unwrapped(original) if original is not None and cls.__dict__.get(name) is not original else func


def classify_method(cls: type, name: str, change: Change) -> Tuple[str, Optional[Callable]]:
    """Classify ``cls.<name>``, a method ``change`` replaces or reads; for PATCHABLE, also return the replacement that
    goes with its form.

    DeepSpeed's own code is PATCHABLE when its fingerprint is a known unfixed form, FIXED when it is this package's
    replacement or when it is the tracker of the class's form and ``change.probe`` finds that it behaves as fixed (so
    an upstream fix in its own words counts), and MISMATCH otherwise.
    """
    func = unwrapped(cls.__dict__.get(name))
    if func is None:
        return MISSING, None
    ours = [replacement for _, replacement in change.replacements(name)]
    if any(func is replacement for replacement in ours):
        return OURS, None
    func = _under_other_change(change, cls, name, func)
    if not _defined_in(func, cls):
        return FOREIGN, None
    digest = fingerprint(func)
    if digest is not None and any(digest == fingerprint(replacement) for replacement in ours):
        return FIXED, None
    replacement = replacement_for(change, name, digest)
    if replacement is not None:
        return PATCHABLE, replacement
    if change.probe is not None and name == change.form_for(cls).tracker and change.probe(cls) is None:
        return FIXED, None
    return MISMATCH, None


@dataclass
class Decision:
    """What the guard found: the state to report, why, each method's finding, and the replacements to install
    (only when the state is ``applied`` and the methods are not ours already)."""

    state: State
    reason: str
    methods: Dict[str, str] = field(default_factory=dict)
    replacements: Dict[str, Callable] = field(default_factory=dict)


def releases_text(releases: Tuple[str, ...]) -> str:
    return releases[0] if len(releases) == 1 else f"{releases[0]} to {releases[-1]}"


def version_refused(version: str) -> Optional[str]:
    """Why no change is made to DeepSpeed ``version`` whatever its code (unparsable, or older than ``FIRST``), or
    None."""
    release = release_of(version)
    if release is None:
        return f"DeepSpeed's version {version!r} cannot be parsed as a version, so the releases it matches are unknown"
    if release < Version(FIRST):
        return f"DeepSpeed {version} is older than the first supported release {FIRST}: {OLDER_REASON}"
    return None


def settled(found: str, cls: type, name: str, version: str, methods: Dict[str, str]) -> Optional[Decision]:
    """The decision that the finding ``found`` of method ``name`` settles alone, for a change that decides in its own
    module: ``applied`` when the method is the package's replacement already, ``conflict`` when someone else replaced
    it (never clobbered), ``upstream-fixed`` when it is the fixed form; None for any other finding."""
    if found == OURS:
        return Decision(State.APPLIED, f"DeepSpeed {version}: already applied", methods)
    if found == FOREIGN:
        return Decision(
            State.CONFLICT, f"{cls.__name__}.{name} already replaced by another patch (now "
            f"{owner(cls.__dict__[name])})", methods)
    if found == FIXED:
        return Decision(State.UPSTREAM_FIXED, f"DeepSpeed {version}: {name} is already the fixed form", methods)
    return None


def decide_by_methods(change: Change, cls: type, version: str) -> Decision:
    """Decide what to do with ``change``'s methods of ``cls`` (``DeepSpeedZeroOptimizer``) on DeepSpeed ``version``,
    in the form that ``cls`` has.

    Order matters: a class already fixed upstream is ``upstream-fixed`` whatever its version (its tracker is our
    replacement's text or behaves as fixed); a method that someone else replaced makes a ``conflict`` (never
    clobbered); a release older than ``FIRST`` is ``unsupported``; then every method must be a known unfixed form.
    A release newer than ``LAST`` whose methods are known unfixed forms is patched, and the reason says so.
    """
    form = change.form_for(cls)
    found = {name: classify_method(cls, name, change) for name in form.methods}
    methods = {name: result for name, (result, _) in found.items()}
    results = set(methods.values())
    if results == {OURS}:
        return Decision(State.APPLIED, f"DeepSpeed {version}: already applied", methods)
    foreign = [name for name, result in methods.items() if result == FOREIGN]
    if results == {FIXED} or (methods[form.tracker] == FIXED and not foreign):
        return Decision(State.UPSTREAM_FIXED, f"DeepSpeed {version} already has the fixed form of {change.name}",
                        methods)
    if foreign:
        owners = ", ".join(f"{name} (now {owner(cls.__dict__[name])})" for name in foreign)
        return Decision(State.CONFLICT, f"{cls.__name__} methods already replaced by another patch: {owners}", methods)
    refused = version_refused(version)
    if refused is not None:
        return Decision(State.UNSUPPORTED, refused, methods)
    odd = [f"{name}: {result}" for name, result in methods.items() if result != PATCHABLE]
    if odd and MISMATCH in results:
        problem = interpreter_problem(change)
        if problem:
            return Decision(State.UNSUPPORTED, f"{problem} ({', '.join(odd)}); DeepSpeed {version} is left unchanged",
                            methods)
    if odd:
        return Decision(
            State.UNSUPPORTED, f"DeepSpeed {version}: {cls.__name__} is not the code this patch was built for "
            f"({', '.join(odd)})", methods)
    # Every method is a known form here; should no one release ship them all, the tracker's releases are said.
    common = (releases_shipping({change.key(name): cls.__dict__[name]
                                 for name in form.methods})
              or releases_shipping({change.key(form.tracker): cls.__dict__[form.tracker]}))
    if newer_than_tested(version):
        reason = (f"DeepSpeed {version} is newer than the releases tested ({FIRST} to {LAST}); its methods match "
                  f"the unfixed form of DeepSpeed {releases_text(common)}")
    else:
        reason = f"DeepSpeed {version}: the methods match a known unfixed form (DeepSpeed {releases_text(common)})"
    return Decision(State.APPLIED, reason, methods, {name: replacement for name, (_, replacement) in found.items()})


def _within_forms(change: Change, version: str) -> bool:
    """Whether ``version`` is a release that shipped one of ``change``'s (defective) forms."""
    release = release_of(version)
    return release is not None and change.form_of(str(release)) is not None


def decide_where_defective(change: Change, cls: type, version: str, right: str) -> Decision:
    """:func:`decide_by_methods` for a change whose defect only some releases have (before it came and after
    DeepSpeed fixed it, the code behaves right): where the tracker is in no known form but ``change.probe`` finds it
    behaving right, the change is ``not-needed`` (``right`` says what the release does), not ``upstream-fixed``; a
    tracker that is this package's replacement text on a release that shipped a defective form (``patches/`` applied
    to DeepSpeed's file) stays ``upstream-fixed`` (the same text on a release from before the defect is its own code:
    ``not-needed``). Code in no known form that the probe finds wrong stays ``unsupported``, and the reason says
    what the probe found."""
    decision = decide_by_methods(change, cls, version)
    tracker = change.form_for(cls).tracker
    if decision.state == State.UNSUPPORTED and decision.methods.get(tracker) == MISMATCH and change.probe:
        # Say what the unknown code does, as the probe found it.
        problem = change.probe(cls)
        if problem:
            return Decision(State.UNSUPPORTED, f"{decision.reason}; its {tracker} {problem}", decision.methods)
    if decision.state != State.UPSTREAM_FIXED:
        return decision
    ours = {fingerprint(function) for _, function in change.replacements(tracker)}
    if fingerprint(cls.__dict__[tracker]) in ours and _within_forms(change, version):
        return decision  # a release that shipped the defect, with the package's text: patches/ applied
    return Decision(State.NOT_NEEDED, f"DeepSpeed {version}: {right} ({tracker} behaves right)", decision.methods)


def owner(func: Callable) -> str:
    module = getattr(func, "__module__", None) or "?"
    qualname = getattr(func, "__qualname__", None) or type(func).__name__
    return f"{module}.{qualname}"
