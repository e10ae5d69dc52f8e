# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Decides whether the loaded DeepSpeed may be patched: version range, fingerprints, conflicts.

Nothing here changes DeepSpeed. :func:`inspect_target` looks at the class that defines the two methods and returns
a :class:`Decision` (the state to report, and which replacement goes with each method); the patcher acts on it.
"""

import importlib
import importlib.util
import inspect
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

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


@dataclass(frozen=True)
class PatchSet:
    """Methods of ``DeepSpeedZeroOptimizer`` that are replaced together, and the module of their replacements.

    ``tracker`` is the one of ``methods`` whose finding says whether DeepSpeed has the fixed form already (the fix's
    overflow tracker; a one-method set's method). ``first_release`` is the first DeepSpeed release whose methods have
    these names, ``until`` the first release that no longer has them (empty: every later one); :attr:`releases` is
    the two as a version specifier. ``witnesses`` are methods that are not replaced but whose code decides whether
    the replacements are right (their forms are fingerprinted too). Raises ValueError when ``tracker`` is not one of
    ``methods``.
    """

    name: str
    module: str
    methods: Tuple[str, ...]
    tracker: str
    first_release: str
    until: str = ""
    witnesses: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.tracker not in self.methods:
            raise ValueError(f"{self.name}: the tracker {self.tracker} is not one of its methods {self.methods}")

    @property
    def releases(self) -> str:
        """The releases whose methods have these names, as a version specifier (``>=0.14.0,<0.17.1``)."""
        return f">={self.first_release}" + (f",<{self.until}" if self.until else "")


_TRACKER = "update_offload_overflow_tracker"
_TRACKER_PER_PARAM = "update_overflow_tracker_for_param_grad"
#: The fix itself (DeepSpeed pull request 8963), applied by default, from DeepSpeed 0.17.1 on.
OVERFLOW_FLAG = PatchSet("overflow-flag",
                         "deepspeed_offload_patch.overflow", (_TRACKER, "has_overflow"),
                         tracker=_TRACKER,
                         first_release="0.17.1")
#: The same fix for DeepSpeed 0.14.0 to 0.17.0, whose tracker is ``update_overflow_tracker_for_param_grad(param)``.
OVERFLOW_FLAG_PER_PARAM = PatchSet("overflow-flag",
                                   "deepspeed_offload_patch.overflow", (_TRACKER_PER_PARAM, "has_overflow"),
                                   tracker=_TRACKER_PER_PARAM,
                                   first_release="0.14.0",
                                   until=OVERFLOW_FLAG.first_release)
#: On by default: the offload gradient norm summed on the device (two forms: a tensor from 0.17.1 on, a number before).
GRAD_NORM = PatchSet("grad-norm-on-device",
                     "deepspeed_offload_patch.grad_norm", ("complete_grad_norm_calculation_for_cpu_offload", ),
                     tracker="complete_grad_norm_calculation_for_cpu_offload",
                     first_release="0.14.0")
#: On by default where DeepSpeed has the defect: a skipped step leaves no gradient in the compact fp32 partition buffer
#: (DeepSpeed 0.19.8). ``step()``'s overflow branch is what calls ``reset_cpu_buffers`` with the buffer still there.
SKIPPED_STEP = PatchSet("skipped-step-buffer",
                        "deepspeed_offload_patch.skipped_step", ("reset_cpu_buffers", ),
                        tracker="reset_cpu_buffers",
                        first_release="0.19.8",
                        witnesses=("step", ))
FIX_FORMS = (OVERFLOW_FLAG, OVERFLOW_FLAG_PER_PARAM)
PATCH_SETS = FIX_FORMS + (GRAD_NORM, SKIPPED_STEP)

#: Every method some patch set replaces or reads (the fingerprint table covers them all).
ALL_METHODS = tuple(dict.fromkeys(name for patch_set in PATCH_SETS
                                  for name in patch_set.methods + patch_set.witnesses))


def fix_for(cls: type) -> PatchSet:
    """The form of the fix that goes with ``cls``: the one whose tracker ``cls`` defines (the current form when it
    defines neither, so that the guard reports the current tracker as missing)."""
    for patch_set in FIX_FORMS:
        if patch_set.tracker in cls.__dict__:
            return patch_set
    return OVERFLOW_FLAG


def fix_methods(cls: type) -> Tuple[str, ...]:
    """The names of the fix's two methods on ``cls``: its tracker and ``has_overflow``."""
    return fix_for(cls).methods


# Per-method findings, reported by status().
PATCHABLE = "patchable"  # DeepSpeed's own unfixed code, in a form with a known fingerprint
FIXED = "fixed"  # already the fixed form
MISMATCH = "mismatch"  # DeepSpeed's own code, in a form this package does not know
FOREIGN = "foreign"  # replaced by someone else
OURS = "ours"  # already replaced by this package
MISSING = "missing"  # not defined on the class


def fingerprint_source(source: str) -> str:
    """Digest of one function's source, blind to formatting, comments, decorators, docstring, its name and the
    interpreter (:func:`deepspeed_offload_patch.source_digest.digest_source`)."""
    return digest_source(source)


def fingerprint(func: Callable) -> Optional[str]:
    """:func:`fingerprint_source` of ``func``, or None when its source cannot be read (no ``.py`` file)."""
    try:
        return fingerprint_source(inspect.getsource(func))
    except (OSError, TypeError, SyntaxError, IndexError, ValueError):
        return None


def own_digests() -> Dict[str, str]:
    """``{"module.function": digest}`` of the top-level functions of the patch sets' modules, read from their files
    on this interpreter (what ``ci/gen_fingerprints.py`` records in :data:`fingerprints.OWN`)."""
    found = {}
    for module in dict.fromkeys(patch_set.module for patch_set in PATCH_SETS):
        spec = importlib.util.find_spec(module)
        path = spec.origin if spec else None
        for name, digest in (module_digests(path) if path and os.path.exists(path) else {}).items():
            found[f"{module.rsplit('.', 1)[-1]}.{name}"] = digest
    return found


def interpreter_problem() -> Optional[str]:
    """None when this interpreter digests the package's own replacements as recorded; else a sentence that names the
    interpreter. A Python that parses code into another tree moves every digest, DeepSpeed's included: then an
    unknown fingerprint says nothing about DeepSpeed."""
    try:
        here = own_digests()
    except (OSError, SyntaxError, ValueError) as exc:
        here = {"error": f"{type(exc).__name__}: {exc}"}
    moved = sorted(name for name in OWN if here.get(name) != OWN[name])
    if not moved:
        return None
    return (f"Python {platform.python_version()} reads code differently from the interpreters this package was "
            f"built on (Python {PYTHONS_TESTED}): the fingerprints of the package's own replacements differ "
            f"({', '.join(moved)}), so the interpreter, not DeepSpeed, is what is unknown; use one of those Pythons "
            "or a release of this package that supports this one")


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


def releases_shipping(functions: Dict[str, Optional[Callable]]) -> Tuple[str, ...]:
    """The releases that ship every one of these forms: for each ``method name: function``, the releases whose
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


def classify_method(cls: type, name: str) -> Tuple[str, Optional[Callable]]:
    """Classify ``cls.<name>``; for PATCHABLE, also return the replacement that goes with its form.

    DeepSpeed's own code is PATCHABLE when its fingerprint is a known unfixed form, FIXED when it is this package's
    replacement or, for the tracker ``update_offload_overflow_tracker``, when :func:`probe_tracker` finds that it
    behaves as fixed (so an upstream fix in its own words counts), and MISMATCH otherwise.
    """
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
    if replacement is not None:
        return PATCHABLE, replacement
    if name == OVERFLOW_FLAG.tracker and probe_tracker(cls) is None:
        return FIXED, None
    return MISMATCH, None


def probe_tracker(cls: type) -> Optional[str]:
    """Try ``cls.update_offload_overflow_tracker`` on bare instances (built without ``__init__``); None when it
    behaves as fixed, else what it did.

    Fixed means: with ``check_grad_overflow`` off it checks nothing and leaves the flag alone; with it on, fed check
    results whose truth value raises (:class:`~deepspeed_offload_patch.hostsync.RaisingBoolTensor`), it reads nothing
    on the host (counted at the dispatcher) and leaves a tensor flag that is true exactly when a result was. Every
    tensor stays on the CPU (device arguments are mapped to it); the tracker may still ask the accelerator for its
    device name. Any exception counts as not fixed. Only code that matches no known form is probed.
    """
    import torch

    from deepspeed_offload_patch.hostsync import RaisingBoolTensor, count_host_syncs, on_the_cpu

    tracker = cls.__dict__[OVERFLOW_FLAG.tracker]
    calls = []

    def check(x, j=None):
        calls.append(x)
        return RaisingBoolTensor.wrap(x.float().isinf().logical_or(x.float().isnan()).any())

    def bare(check_on: bool):
        optimizer = cls.__new__(cls)
        optimizer.check_grad_overflow = check_on
        optimizer.cpu_offload = True
        optimizer.local_overflow = False
        optimizer._has_inf_or_nan = check
        return optimizer

    bad = torch.tensor([1.0, float("inf")])
    try:
        with on_the_cpu(), count_host_syncs(device="cpu") as syncs:  # its tensors are all on the CPU: count all
            off = bare(False)
            tracker(off, bad)
            if calls or off.local_overflow is not False:
                return "checks gradients with check_grad_overflow off"
            clean, flagged = bare(True), bare(True)
            for grad in (torch.ones(3), torch.zeros(2)):
                tracker(clean, grad)
            for grad in (torch.ones(3), bad, torch.zeros(2)):
                tracker(flagged, grad)
        if syncs.total:
            return f"reads device values on the host: {dict(syncs.counts)}"
        flags = [
            RaisingBoolTensor.plain(o.local_overflow) if torch.is_tensor(o.local_overflow) else o.local_overflow
            for o in (clean, flagged)
        ]
        if not all(torch.is_tensor(flag) and flag.numel() == 1 for flag in flags):
            return f"keeps the flag on the host ({type(flags[1]).__name__})"
        if flags[0].item() or not flags[1].item():
            return "the flag does not record exactly the overflows"
    except Exception as exc:  # unknown code: whatever it does wrong, it is not the fixed form
        return f"raised {type(exc).__name__}: {exc}"
    return None


@dataclass
class Decision:
    """What the guard found: the state to report, why, each method's finding, and the replacements to install
    (only when the state is ``applied`` and the methods are not ours already)."""

    state: State
    reason: str
    methods: Dict[str, str] = field(default_factory=dict)
    replacements: Dict[str, Callable] = field(default_factory=dict)


def _releases_text(releases: Tuple[str, ...]) -> str:
    return releases[0] if len(releases) == 1 else f"{releases[0]} to {releases[-1]}"


def _version_refused(version: str) -> Optional[str]:
    """Why no change is made to DeepSpeed ``version`` whatever its code (unparsable, or older than ``FIRST``), or
    None."""
    release = release_of(version)
    if release is None:
        return f"DeepSpeed's version {version!r} cannot be parsed as a version, so the releases it matches are unknown"
    if release < Version(FIRST):
        return f"DeepSpeed {version} is older than the first supported release {FIRST}: {OLDER_REASON}"
    return None


def inspect_target(cls: type, version: str, patch_set: Optional[PatchSet] = None) -> Decision:
    """Decide what to do with ``patch_set``'s methods of ``cls`` (``DeepSpeedZeroOptimizer``) on DeepSpeed
    ``version``; by default, the fix in the form that ``cls`` has (:func:`fix_for`).

    Order matters: a class already fixed upstream is ``upstream-fixed`` whatever its version (its tracker is our
    replacement's text or behaves as fixed); a method that someone else replaced makes a ``conflict`` (never
    clobbered); a release older than ``FIRST`` is ``unsupported``; then every method must be a known unfixed form.
    A release newer than ``LAST`` whose methods are known unfixed forms is patched, and the reason says so.
    """
    patch_set = patch_set or fix_for(cls)
    found = {name: classify_method(cls, name) for name in patch_set.methods}
    methods = {name: result for name, (result, _) in found.items()}
    results = set(methods.values())
    if results == {OURS}:
        return Decision(State.APPLIED, f"DeepSpeed {version}: already applied", methods)
    foreign = [name for name, result in methods.items() if result == FOREIGN]
    if results == {FIXED} or (methods[patch_set.tracker] == FIXED and not foreign):
        return Decision(State.UPSTREAM_FIXED, f"DeepSpeed {version} already has the fixed form of {patch_set.name}",
                        methods)
    if foreign:
        owners = ", ".join(f"{name} (now {_owner(cls.__dict__[name])})" for name in foreign)
        return Decision(State.CONFLICT, f"{cls.__name__} methods already replaced by another patch: {owners}", methods)
    refused = _version_refused(version)
    if refused is not None:
        return Decision(State.UNSUPPORTED, refused, methods)
    odd = [f"{name}: {result}" for name, result in methods.items() if result != PATCHABLE]
    if odd and MISMATCH in results:
        problem = interpreter_problem()
        if problem:
            return Decision(State.UNSUPPORTED, f"{problem} ({', '.join(odd)}); DeepSpeed {version} is left unchanged",
                            methods)
    if odd:
        return Decision(
            State.UNSUPPORTED, f"DeepSpeed {version}: {cls.__name__} is not the code this patch was built for "
            f"({', '.join(odd)})", methods)
    # Every method is a known form here; should no one release ship them all, the tracker's releases are said.
    common = (releases_shipping({name: cls.__dict__[name]
                                 for name in patch_set.methods})
              or releases_shipping({patch_set.tracker: cls.__dict__[patch_set.tracker]}))
    if newer_than_tested(version):
        reason = (f"DeepSpeed {version} is newer than the releases tested ({FIRST} to {LAST}); its methods match "
                  f"the unfixed form of DeepSpeed {_releases_text(common)}")
    else:
        reason = f"DeepSpeed {version}: the methods match a known unfixed form (DeepSpeed {_releases_text(common)})"
    return Decision(State.APPLIED, reason, methods, {name: replacement for name, (_, replacement) in found.items()})


class _BufferGroup(list):
    """A compact gradient partition group as DeepSpeed 0.19.8 keeps one: views, and the flat partition they share."""

    def __init__(self, flat_partition):
        super().__init__([flat_partition])
        self.flat_partition = flat_partition


class _Timer:

    def start(self):
        pass

    def stop(self):
        pass


def probe_skipped_step(cls: type) -> Optional[str]:
    """Run ``cls.step`` once on a bare instance (built without ``__init__``) whose overflow check finds an overflow,
    with the optimizer offloaded and a compact gradient buffer holding an inf; None when, after the skipped step, the
    buffer is gone or holds no inf/NaN (DeepSpeed's own fix, in any words, of ``step()`` or ``reset_cpu_buffers``),
    else what it did. ``step()``'s collaborators are stubbed on the instance (the check, the loss scale, the timers,
    waiting for copies); any exception counts as not fixed. Only code that matches no known form is probed."""
    import torch

    optimizer = cls.__new__(cls)
    group = _BufferGroup(torch.tensor([1.0, float("inf")]))

    def check_overflow(partition_gradients=True):
        optimizer.overflow = True

    state = dict(micro_step_id=0,
                 cpu_offload=True,
                 compute_grad_norm=False,
                 check_grad_overflow=True,
                 partition_gradients=True,
                 overflow=False,
                 custom_loss_scaler=True,
                 external_loss_scale=1.0,
                 averaged_gradients={0: group},
                 all_grad_tensors={0: None},
                 norm_for_param_grads={},
                 local_overflow=False,
                 _global_grad_norm=None,
                 _offload_accumulated_param_ids=set(),
                 check_overflow=check_overflow,
                 _wait_for_offload_copies=lambda: None,
                 _update_scale=lambda overflow: None,
                 zero_grad=lambda set_to_none=True: None,
                 timers=lambda name: _Timer(),
                 _use_compact_grad_partition_buffer=lambda group_idx: True)
    try:
        vars(optimizer).update(state)
        cls.step(optimizer)
        if not optimizer.overflow:
            return "did not take the overflow branch"
        left = optimizer.averaged_gradients.get(0)
        tensors = [getattr(left, "flat_partition", None)] + (list(left) if isinstance(left, list) else [left])
        if any(torch.is_tensor(t) and not torch.isfinite(t).all() for t in tensors):
            return "keeps the skipped step's inf/NaN in its compact gradient buffer"
    except Exception as exc:  # unknown code: whatever it does wrong, it is not the fixed form
        return f"raised {type(exc).__name__}: {exc}"
    return None


def inspect_skipped_step(cls: type, version: str) -> Decision:
    """Decide on :data:`SKIPPED_STEP` for ``cls``: ``not-needed`` without a compact gradient buffer (DeepSpeed before
    0.19.8); ``applied`` (with the replacement) when ``reset_cpu_buffers`` and ``step`` are the known forms;
    ``conflict`` when someone else replaced ``reset_cpu_buffers``; otherwise :func:`probe_skipped_step` decides
    between ``upstream-fixed`` and ``unsupported`` (whose reason names the interpreter where it, not DeepSpeed, is
    what changed)."""
    name, (witness, ) = SKIPPED_STEP.tracker, SKIPPED_STEP.witnesses
    refused = _version_refused(version)
    if refused is not None:
        return Decision(State.UNSUPPORTED, refused)
    if not hasattr(cls, "_use_compact_grad_partition_buffer"):
        return Decision(
            State.NOT_NEEDED, f"DeepSpeed {version} has no compact fp32 gradient partition buffer (added in "
            f"{SKIPPED_STEP.first_release}): a "
            "skipped step leaves no gradient behind")
    found, replacement = classify_method(cls, name)
    step = cls.__dict__.get(witness)
    step_known = step is not None and fingerprint(step) in UNFIXED.get(witness, {})
    methods = {name: found, witness: PATCHABLE if step_known else (MISMATCH if step is not None else MISSING)}
    if found == OURS:
        return Decision(State.APPLIED, f"DeepSpeed {version}: already applied", methods)
    if found == FOREIGN:
        return Decision(
            State.CONFLICT, f"{cls.__name__}.{name} already replaced by another patch (now "
            f"{_owner(cls.__dict__[name])})", methods)
    if found == FIXED:
        return Decision(State.UPSTREAM_FIXED, f"DeepSpeed {version}: {name} is already the fixed form", methods)
    if found == PATCHABLE and step_known:
        releases = releases_shipping({witness: step})
        form = (f"step() and {name} match the form of DeepSpeed {_releases_text(releases)}, whose skipped steps keep "
                "their gradient")
        if newer_than_tested(version):
            reason = f"DeepSpeed {version} is newer than the releases tested ({FIRST} to {LAST}); its {form}"
        else:
            reason = f"DeepSpeed {version}: {form}"
        return Decision(State.APPLIED, reason, methods, {name: replacement})
    problem = probe_skipped_step(cls)
    if problem is None:
        return Decision(
            State.UPSTREAM_FIXED, f"DeepSpeed {version}: a skipped step leaves no gradient behind (its "
            "step() behaves as fixed)", methods)
    odd = ", ".join(f"{method}: {result}" for method, result in methods.items() if result != PATCHABLE)
    python = interpreter_problem() if MISMATCH in methods.values() else None
    if python:
        return Decision(State.UNSUPPORTED, f"{python} ({odd}); DeepSpeed {version} is left unchanged", methods)
    return Decision(
        State.UNSUPPORTED, f"DeepSpeed {version}: {cls.__name__}.step {problem}, in a form this fix was not built for "
        f"({odd})", methods)


def _owner(func: Callable) -> str:
    module = getattr(func, "__module__", None) or "?"
    qualname = getattr(func, "__qualname__", None) or type(func).__name__
    return f"{module}.{qualname}"
