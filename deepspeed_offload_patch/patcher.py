# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Applies and reverts the patch: the registry of originals, the lazy hook, the state that ``status()`` reports."""

import gc
import importlib
import importlib.metadata
import importlib.util
import sys
import threading
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Callable, Dict, List, Optional

from deepspeed_offload_patch import import_hook, settings
from deepspeed_offload_patch.log import info_once, warn_once
# GOOD_STATES: re-exported by the package (deepspeed_offload_patch.GOOD_STATES).
from deepspeed_offload_patch.states import GOOD_STATES, State  # noqa: F401

TARGET_MODULE = "deepspeed.runtime.zero.stage_1_and_2"
TARGET_CLASS = "DeepSpeedZeroOptimizer"


class PatchError(RuntimeError):
    """The patch cannot apply and strict mode (``DS_OFFLOAD_PATCH_STRICT=1``) asks for an error."""


@dataclass
class PatchStatus:
    """Where the patch stands in this process.

    ``state`` is the fix's (the overflow flag on the device): one of applied, pending (DeepSpeed's ZeRO module is not
    imported yet; the patch applies when it is), upstream-fixed, unsupported, conflict, disabled, deepspeed-missing,
    reverted or not-applied (before the package's import has run). ``methods`` maps each examined method to the
    guard's finding (see :mod:`deepspeed_offload_patch.guard`). ``grad_norm_on_device`` is the on-device gradient norm's (on by
    default): off (switched off), applied, upstream-fixed, unsupported, conflict or reverted, with
    ``grad_norm_reason``; it is decided with the fix, as ``skipped_step`` is.
    ``skipped_step`` is the skipped-step fix's (on by default): off (switched off), applied, not-needed (the
    DeepSpeed has no such defect), upstream-fixed, unsupported, conflict or reverted, with ``skipped_step_reason``;
    it is decided with the fix (pending, disabled and the rest leave it ``off``).
    """

    state: State
    deepspeed_version: Optional[str]
    reason: str
    methods: Dict[str, str] = field(default_factory=dict)
    grad_norm_on_device: State = State.OFF
    grad_norm_reason: str = ""
    skipped_step: State = State.OFF
    skipped_step_reason: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class AppliedPatch:
    """What one patch set installed on DeepSpeed's class in this process: the class, DeepSpeed's functions and their
    replacements (by method name), and the ``__init_subclass__`` hook it added to the class (None when the class had
    one already: DeepSpeed's own, or an earlier set's)."""

    patch_set: str  # the PatchSet's name
    cls: type
    originals: Dict[str, Callable]
    replacements: Dict[str, Callable]
    subclass_watch: Optional[object] = None

    def ours(self, name: str) -> bool:
        """Whether the class's attribute ``name`` is still this set's replacement."""
        return name in self.replacements and self.cls.__dict__.get(name) is self.replacements[name]


_lock = threading.RLock()
#: The patch sets applied in this process, by PatchSet name, in the order they applied; emptied by revert().
_applied: Dict[str, AppliedPatch] = {}
_status = PatchStatus(State.NOT_APPLIED, None, "the patch has not been applied in this process")


def deepspeed_version() -> Optional[str]:
    """The version of the DeepSpeed that is (or would be) imported, without importing DeepSpeed itself.

    While ``deepspeed/__init__.py`` runs, ``deepspeed.__version__`` is not set yet; its ``git_version_info`` module
    is small and answers then. Without DeepSpeed loaded, the installed distribution's metadata answers. None when
    DeepSpeed is not installed.
    """
    module = sys.modules.get("deepspeed")
    if module is not None:
        version = getattr(module, "__version__", None)
        if version is None:
            try:
                version = importlib.import_module("deepspeed.git_version_info").version
            except Exception:
                version = None
        if version is not None:
            return str(version)
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def deepspeed_installed() -> bool:
    try:
        return importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):  # ValueError: a None or spec-less entry in sys.modules
        return False


def _set(state: State,
         reason: str,
         methods: Optional[Dict[str, str]] = None,
         grad_norm=None,
         skipped_step=None) -> "PatchStatus":
    """Record the status; ``grad_norm`` and ``skipped_step`` are those changes' ``(state, reason)``, kept as they
    were when None."""
    global _status
    if grad_norm is None:
        grad_norm = (_status.grad_norm_on_device, _status.grad_norm_reason)
    if skipped_step is None:
        skipped_step = (_status.skipped_step, _status.skipped_step_reason)
    _status = PatchStatus(state, deepspeed_version(), reason, dict(methods or {}), *grad_norm, *skipped_step)
    return _status


def _log_or_raise(what: str, state: State, reason: str, strict: bool) -> None:
    """Log the outcome of one change: INFO when applied or not needed, one WARNING when it cannot apply (unsupported,
    conflict); nothing for other states. Raises PatchError instead of that WARNING when ``strict``."""
    if state == State.APPLIED:
        info_once(f"{what}: applied: {reason}")
    elif state in (State.UPSTREAM_FIXED, State.NOT_NEEDED):
        info_once(f"{what}: not needed: {reason}")
    elif state in (State.UNSUPPORTED, State.CONFLICT):
        message = f"{what} not applied ({state}): {reason}; DeepSpeed is left unchanged"
        if strict:
            raise PatchError(message)
        warn_once(message)


def _apply_set(cls: type, patch_set):
    """Let the guard decide on ``patch_set``'s methods of ``cls`` and install its replacements if it says so."""
    from deepspeed_offload_patch.guard import SKIPPED_STEP, inspect_skipped_step, inspect_target

    version = deepspeed_version() or "unknown"
    if patch_set is SKIPPED_STEP:
        decision = inspect_skipped_step(cls, version)
    else:
        decision = inspect_target(cls, version, patch_set)
    if decision.replacements:
        record = AppliedPatch(patch_set.name, cls, {name: cls.__dict__[name]
                                                    for name in decision.replacements}, dict(decision.replacements))
        _applied[patch_set.name] = record
        for name, replacement in decision.replacements.items():
            setattr(cls, name, replacement)
        for sub in _subclasses(cls):
            _warn_if_overriding(sub)
        record.subclass_watch = _watch_subclasses(cls)
    return decision


def _patch_module(module: ModuleType, strict: bool, grad_norm: bool) -> PatchStatus:
    """Apply the fix, the skipped-step fix unless switched off, and the on-device grad norm if ``grad_norm``, to the
    loaded ZeRO module."""
    from deepspeed_offload_patch.guard import GRAD_NORM, SKIPPED_STEP, fix_for

    skipped_step = settings.skipped_step()
    with _lock:
        cls = getattr(module, TARGET_CLASS, None)
        if cls is None:
            missing = (State.UNSUPPORTED, f"{TARGET_MODULE} has no {TARGET_CLASS}")
            status = _set(*missing,
                          grad_norm=missing if grad_norm else _left_out(settings.GRAD_NORM),
                          skipped_step=missing if skipped_step else _left_out(settings.SKIPPED_STEP))
        else:
            form = fix_for(cls)
            fix = _apply_set(cls, form)
            methods = dict(fix.methods)
            states = {}
            for name, patch_set, on, switch in (("grad_norm", GRAD_NORM, grad_norm, settings.GRAD_NORM),
                                                ("skipped_step", SKIPPED_STEP, skipped_step, settings.SKIPPED_STEP)):
                if on:
                    found = _apply_set(cls, patch_set)
                    methods.update(found.methods)
                    states[name] = (found.state, found.reason)
                else:
                    states[name] = _left_out(switch)
            status = _set(fix.state, fix.reason, methods, **states)
    _log_or_raise("the offload overflow flag fix", status.state, status.reason, strict)
    # One message per cause: a DeepSpeed that the changes refuse for the same reason (its version) is said once.
    if grad_norm and (status.grad_norm_on_device, status.grad_norm_reason) != (status.state, status.reason):
        _log_or_raise("the on-device grad norm", status.grad_norm_on_device, status.grad_norm_reason, strict)
    if skipped_step and (status.skipped_step, status.skipped_step_reason) != (status.state, status.reason):
        _log_or_raise("the skipped-step fix", status.skipped_step, status.skipped_step_reason, strict)
    return status


def _left_out(switch: str) -> tuple:
    """The state of a default-on change that its switch (or ``UPSTREAM_ONLY``) leaves out."""
    which = settings.UPSTREAM_ONLY if settings.upstream_only() else f"{switch}=0"
    return (State.OFF, f"{which}: left out")


def _restore(module: ModuleType) -> None:
    """Put back every original whose attribute is still ours, and forget every applied set."""
    if not _applied:
        return
    for record in _applied.values():
        for name, original in record.originals.items():
            if record.ours(name):
                setattr(record.cls, name, original)
            else:
                warn_once(f"revert: {TARGET_CLASS}.{name} was replaced by someone else after the patch; left as is")
        watch = record.subclass_watch
        if watch is not None and record.cls.__dict__.get("__init_subclass__") is watch:
            del record.cls.__init_subclass__
    _applied.clear()
    _settle_live_flags(getattr(module, TARGET_CLASS))


def _settle_live_flags(cls: type) -> None:
    """Turn a device flag that the patched tracker left in a live optimizer into the Python bool that DeepSpeed's
    own methods keep there (one host read per optimizer, once). Optimizers are found through the garbage collector,
    which tracks every instance: revert is rare, and the patch keeps no references to them."""
    import torch

    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which some lazy module objects warn about.
        if issubclass(type(obj), cls) and torch.is_tensor(vars(obj).get("local_overflow")):
            obj.local_overflow = bool(obj.local_overflow)


def _subclasses(cls: type) -> List[type]:
    found, pending = [], list(cls.__subclasses__())
    while pending:
        sub = pending.pop()
        if sub not in found:
            found.append(sub)
            pending.extend(sub.__subclasses__())
    return found


def _warn_if_overriding(sub: type) -> None:
    """A subclass that defines a patched method itself runs its own method, not the patch's: say which."""
    for name in [name for record in list(_applied.values()) for name in record.replacements]:
        if name in sub.__dict__:
            warn_once(f"{sub.__module__}.{sub.__qualname__} overrides {TARGET_CLASS}.{name}: its instances run "
                      f"that override instead of the patch's {name} (the other patched method still applies)")


def _watch_subclasses(cls: type) -> Optional[object]:
    """Warn about overriding subclasses defined after the patch, too: hook their creation with
    ``__init_subclass__`` on the patched class (removed on revert). Returns the hook; None, and nothing added, when
    the class has one already (DeepSpeed's own, or the hook of a set applied before)."""
    if "__init_subclass__" in cls.__dict__:
        return None

    def __init_subclass__(sub, **kwargs):
        super(cls, sub).__init_subclass__(**kwargs)
        _warn_if_overriding(sub)

    cls.__init_subclass__ = classmethod(__init_subclass__)
    return cls.__dict__["__init_subclass__"]


def _target_failed(exc: BaseException) -> PatchStatus:
    status = _set(
        State.UNSUPPORTED, f"{TARGET_MODULE} failed to import ({type(exc).__name__}: {exc}); the patch applies "
        f"when an import of it succeeds")
    _log_or_raise("the offload overflow flag fix", status.state, status.reason, strict=False)
    return status


def _on_target_import_error(exc: BaseException) -> None:
    """The lazy hook, when DeepSpeed's ZeRO module fails to import: say so once. The importer gets DeepSpeed's own
    exception, unchanged (strict mode adds nothing to it)."""
    if isinstance(exc, Exception):
        with _lock:
            _target_failed(exc)


def _on_target_import(module: ModuleType) -> None:
    """The lazy hook: patch as DeepSpeed's ZeRO module is imported. Never breaks that import unless strict."""
    strict = settings.strict()
    try:
        _patch_module(module, strict, settings.grad_norm())
    except PatchError:
        raise
    except Exception as exc:  # a bug here must not stop training
        _restore(module)
        status = _set(State.UNSUPPORTED, f"internal error while patching: {exc!r}")
        _log_or_raise("the patch", status.state, status.reason, strict)


def patch_on_import() -> PatchStatus:
    """What importing the package does: patch now if DeepSpeed's ZeRO module is loaded, else when it is imported.

    Does not import DeepSpeed. Honours ``DS_OFFLOAD_PATCH_DISABLE``, and ``DS_OFFLOAD_PATCH_AUTO=0`` (the import
    patches nothing; state ``not-applied``, ``apply()`` still patches). Returns the resulting status.
    """
    with _lock:
        if settings.disabled():
            return _set(State.DISABLED, f"{settings.DISABLE} is set")
        if not settings.auto():
            return _set(State.NOT_APPLIED, f"{settings.AUTO}=0: importing the package patches nothing; apply() does")
        if not deepspeed_installed():
            status = _set(State.DEEPSPEED_MISSING, "DeepSpeed is not installed (no importable 'deepspeed' package)")
            warn_once(f"the offload overflow flag fix not applied ({status.state}): {status.reason}; pip install "
                      f"deepspeed, then import deepspeed_offload_patch again in a new process")
            return status
        if TARGET_MODULE not in sys.modules:
            _set(State.PENDING, f"waiting for {TARGET_MODULE} to be imported")
        import_hook.when_imported(TARGET_MODULE, _on_target_import, _on_target_import_error)
        return _status


def apply(grad_norm_on_device: Optional[bool] = None) -> PatchStatus:
    """Patch DeepSpeed now, importing its ZeRO module if needed. A second call changes nothing.

    ``grad_norm_on_device`` (default: ``DS_OFFLOAD_PATCH_GRAD_NORM``, on unless it is 0) says whether to apply the
    on-device gradient norm too; ``False`` does not undo one already applied (``revert()`` does).

    Returns the status: ``applied`` on success; ``upstream-fixed``, ``unsupported`` or ``conflict`` (with one
    WARNING, DeepSpeed untouched) otherwise; ``disabled`` under ``DS_OFFLOAD_PATCH_DISABLE=1``. The grad norm's own
    state is in ``grad_norm_on_device``.

    Raises:
        ImportError: DeepSpeed is not installed (the message names the ``deepspeed`` package).
        PatchError: the patch cannot apply, or DeepSpeed's ZeRO module fails to import, and
            ``DS_OFFLOAD_PATCH_STRICT=1`` is set. Without strict mode, a failing import is reported as
            ``unsupported`` (the reason names the exception) with one WARNING.
    """
    with _lock:
        if settings.disabled():
            return _set(State.DISABLED, f"{settings.DISABLE} is set")
        if not deepspeed_installed():
            _set(State.DEEPSPEED_MISSING, "DeepSpeed is not installed (no importable 'deepspeed' package)")
            raise ImportError("deepspeed_offload_patch.apply() needs the 'deepspeed' package: pip install deepspeed",
                              name="deepspeed")
    # Imported outside the lock: the import takes Python's module lock, and the lazy hook, which may run inside
    # that import on this or another thread, takes ours.
    try:
        module = importlib.import_module(TARGET_MODULE)
    except Exception as exc:
        with _lock:
            status = _target_failed(exc)
        if settings.strict():
            raise PatchError(f"the offload overflow flag fix not applied: {status.reason}") from exc
        return status
    with _lock:
        import_hook.cancel(TARGET_MODULE)
        grad_norm = settings.grad_norm() if grad_norm_on_device is None else grad_norm_on_device
        return _patch_module(module, settings.strict(), grad_norm)


def revert() -> PatchStatus:
    """Put DeepSpeed's original methods back (the same function objects), where the attribute is still ours.

    A method that someone replaced after the patch is left as it is, with a warning. A pending lazy patch is
    cancelled. Live optimizers use the originals from their next call on.
    """
    with _lock:
        import_hook.cancel(TARGET_MODULE)
        module = sys.modules.get(TARGET_MODULE)
        if not _applied or module is None:
            return _set(State.REVERTED,
                        "the pending patch was cancelled") if _status.state == State.PENDING else status()
        had_grad_norm = _status.grad_norm_on_device == State.APPLIED
        had_skipped_step = _status.skipped_step == State.APPLIED
        _restore(module)
        restored = (State.REVERTED, "revert() restored DeepSpeed's original method")
        return _set(State.REVERTED,
                    "revert() restored DeepSpeed's original methods",
                    grad_norm=restored if had_grad_norm else None,
                    skipped_step=restored if had_skipped_step else None)


def is_applied() -> bool:
    """True when both methods of the fix (in the form the loaded DeepSpeed has) are this package's replacements right
    now (the grad norm and the skipped-step fix aside)."""
    from deepspeed_offload_patch.guard import fix_methods

    module = sys.modules.get(TARGET_MODULE)
    cls = getattr(module, TARGET_CLASS, None)
    if cls is None:
        return False
    return all(_still_ours(name) for name in fix_methods(cls))


def status() -> PatchStatus:
    """The current status. Reports ``conflict`` (for the fix, the grad norm or the skipped-step fix) if someone
    replaced a patched method after the patch applied."""
    with _lock:
        current = PatchStatus(**_status.as_dict())
        if current.state == State.APPLIED and not is_applied():
            current.state = State.CONFLICT
            current.reason = f"{TARGET_CLASS} methods were replaced by someone else after the patch applied"
        if State.APPLIED in (current.grad_norm_on_device, current.skipped_step):
            from deepspeed_offload_patch.guard import GRAD_NORM, SKIPPED_STEP

            for state, reason, patch_set in (("grad_norm_on_device", "grad_norm_reason", GRAD_NORM),
                                             ("skipped_step", "skipped_step_reason", SKIPPED_STEP)):
                if getattr(current, state) == State.APPLIED and not all(map(_still_ours, patch_set.methods)):
                    setattr(current, state, State.CONFLICT)
                    setattr(
                        current, reason, f"{TARGET_CLASS}.{', '.join(patch_set.methods)} was replaced by "
                        "someone else after the patch applied")
        return current


def originals() -> Dict[str, Callable]:
    """DeepSpeed's own functions that the applied patch sets replaced, by method name (a copy; empty before the patch
    applies and after ``revert()``)."""
    with _lock:
        return {name: original for record in _applied.values() for name, original in record.originals.items()}


def _still_ours(name: str) -> bool:
    """Whether method ``name`` of the loaded DeepSpeed's class is still the replacement an applied set installed."""
    cls = getattr(sys.modules.get(TARGET_MODULE), TARGET_CLASS, None)
    return cls is not None and any(record.cls is cls and record.ours(name) for record in _applied.values())
