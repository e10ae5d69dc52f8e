# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Applies and reverts the patch: the registry of originals, the lazy hook, the state that ``status()`` reports."""

import gc
import importlib
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from deepspeed_offload_patch import import_hook, settings
from deepspeed_offload_patch.changes import CHANGES, OTHERS, UPSTREAM
from deepspeed_offload_patch.changes.record import Change
from deepspeed_offload_patch.log import info_once, warn_once
# PatchStatus and deepspeed_version: re-exported (deepspeed_offload_patch.PatchStatus; patcher.deepspeed_version).
from deepspeed_offload_patch.patch_status import PatchStatus, deepspeed_installed, deepspeed_version  # noqa: F401
# GOOD_STATES: re-exported by the package (deepspeed_offload_patch.GOOD_STATES).
from deepspeed_offload_patch.states import GOOD_STATES, State  # noqa: F401

TARGET_MODULE = "deepspeed.runtime.zero.stage_1_and_2"
TARGET_CLASS = "DeepSpeedZeroOptimizer"


class PatchError(RuntimeError):
    """The patch cannot apply and strict mode (``DS_OFFLOAD_PATCH_STRICT=1``) asks for an error."""


@dataclass
class AppliedPatch:
    """What one change installed on DeepSpeed's class in this process: the class, DeepSpeed's functions and their
    replacements (by method name), and the ``__init_subclass__`` hook it added to the class (None when the class had
    one already: DeepSpeed's own, or an earlier change's)."""

    change: str  # the change's name
    cls: type
    originals: Dict[str, Callable]
    replacements: Dict[str, Callable]
    subclass_watch: Optional[object] = None

    def ours(self, name: str) -> bool:
        """Whether the class's attribute ``name`` is still this change's replacement."""
        return name in self.replacements and self.cls.__dict__.get(name) is self.replacements[name]


_lock = threading.RLock()
#: The changes applied in this process, by name, in the order they applied; emptied by revert().
_applied: Dict[str, AppliedPatch] = {}
_status = PatchStatus(State.NOT_APPLIED, None, "the patch has not been applied in this process")


def _set(state: State,
         reason: str,
         methods: Optional[Dict[str, str]] = None,
         others: Optional[Mapping[str, Tuple[State, str]]] = None) -> "PatchStatus":
    """Record the status; ``others`` gives other changes' ``(state, reason)`` by name, each kept as it was when not
    given."""
    global _status
    changes = dict(_status.changes)
    changes.update(others or {})
    _status = PatchStatus(state, deepspeed_version(), reason, dict(methods or {}), changes)
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


def _apply_change(cls: type, change: Change):
    """Let the change decide on its methods of ``cls`` and install its replacements if it says so."""
    decision = change.decide(change, cls, deepspeed_version() or "unknown")
    if decision.replacements:
        record = AppliedPatch(change.name, cls, {name: cls.__dict__[name]
                                                 for name in decision.replacements}, dict(decision.replacements))
        _applied[change.name] = record
        for name, replacement in decision.replacements.items():
            setattr(cls, name, replacement)
        for sub in _subclasses(cls):
            _warn_if_overriding(sub)
        record.subclass_watch = _watch_subclasses(cls)
    return decision


def _patch_module(module: ModuleType, strict: bool, on: Mapping[str, bool]) -> PatchStatus:
    """Apply the upstream change, and each other change that ``on`` (by name) switches on, to the loaded ZeRO
    module."""
    with _lock:
        cls = getattr(module, TARGET_CLASS, None)
        if cls is None:
            missing = (State.UNSUPPORTED, f"{TARGET_MODULE} has no {TARGET_CLASS}")
            status = _set(*missing, others={c.name: missing if on[c.name] else _left_out(c) for c in OTHERS})
        else:
            found, methods = {}, {}
            for change in CHANGES:
                if change.upstream or on[change.name]:
                    decision = _apply_change(cls, change)
                    methods.update(decision.methods)
                    found[change.name] = (decision.state, decision.reason)
                else:
                    found[change.name] = _left_out(change)
            status = _set(*found.pop(UPSTREAM.name), methods, others=found)
    _log_or_raise(UPSTREAM.title, status.state, status.reason, strict)
    # One message per cause: a DeepSpeed that the changes refuse for the same reason (its version) is said once.
    for change in OTHERS:
        if on[change.name] and status.of(change) != (status.state, status.reason):
            _log_or_raise(change.title, *status.of(change), strict)
    return status


def _left_out(change: Change) -> tuple:
    """The state of a default-on change that its switch (or ``UPSTREAM_ONLY``) leaves out."""
    which = settings.UPSTREAM_ONLY if settings.upstream_only() else f"{change.switch}=0"
    return (State.OFF, f"{which}: left out")


def _switched_on() -> Dict[str, bool]:
    """Whether each other change is on, by name, as the switches say."""
    return {change.name: settings.change_on(change) for change in OTHERS}


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
    _log_or_raise(UPSTREAM.title, status.state, status.reason, strict=False)
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
        _patch_module(module, strict, _switched_on())
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
            warn_once(f"{UPSTREAM.title} not applied ({status.state}): {status.reason}; pip install "
                      f"deepspeed, then import deepspeed_offload_patch again in a new process")
            return status
        if TARGET_MODULE not in sys.modules:
            _set(State.PENDING, f"waiting for {TARGET_MODULE} to be imported")
        import_hook.when_imported(TARGET_MODULE, _on_target_import, _on_target_import_error)
        return _status


def apply(changes: Optional[Mapping[str, bool]] = None) -> PatchStatus:
    """Patch DeepSpeed now, importing its ZeRO module if needed. A second call changes nothing.

    ``changes`` says, by change name (:data:`deepspeed_offload_patch.changes.OTHERS`), whether to apply each change beside the upstream one, which is always applied; a change it does
    not name follows its switch (on unless the switch is 0 or ``DS_OFFLOAD_PATCH_UPSTREAM_ONLY=1``). ``False`` does
    not undo a change already applied (``revert()`` does).

    Returns the status: ``applied`` on success; ``upstream-fixed``, ``unsupported`` or ``conflict`` (with one
    WARNING, DeepSpeed untouched) otherwise; ``disabled`` under ``DS_OFFLOAD_PATCH_DISABLE=1``. Each other change's
    state is in ``status.changes``.

    Raises:
        ImportError: DeepSpeed is not installed (the message names the ``deepspeed`` package).
        LookupError: ``changes`` names no change of this package, or the upstream one.
        PatchError: the patch cannot apply, or DeepSpeed's ZeRO module fails to import, and
            ``DS_OFFLOAD_PATCH_STRICT=1`` is set. Without strict mode, a failing import is reported as
            ``unsupported`` (the reason names the exception) with one WARNING.
    """
    unknown = sorted(set(changes or {}) - {change.name for change in OTHERS})
    if unknown:
        raise LookupError(f"apply(): no change to switch is called {', '.join(unknown)} (changes: "
                          f"{', '.join(change.name for change in OTHERS)})")
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
            raise PatchError(f"{UPSTREAM.title} not applied: {status.reason}") from exc
        return status
    with _lock:
        import_hook.cancel(TARGET_MODULE)
        return _patch_module(module, settings.strict(), {**_switched_on(), **(changes or {})})


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
        had = [change.name for change in OTHERS if _status.of(change)[0] == State.APPLIED]
        _restore(module)
        restored = (State.REVERTED, "revert() restored DeepSpeed's original method")
        return _set(State.REVERTED,
                    "revert() restored DeepSpeed's original methods",
                    others=dict.fromkeys(had, restored))


def is_applied() -> bool:
    """True when the upstream change's methods (in the form the loaded DeepSpeed has) are this package's replacements
    right now (the other changes aside)."""
    return _still_applied(UPSTREAM)


def _still_applied(change: Change) -> bool:
    """Whether ``change``'s methods, in the loaded class's form, are all still its replacements."""
    cls = getattr(sys.modules.get(TARGET_MODULE), TARGET_CLASS, None)
    return cls is not None and all(_still_ours(name) for name in change.form_for(cls).methods)


def status() -> PatchStatus:
    """The current status. Reports ``conflict`` (for any change) if someone replaced a patched method after the patch
    applied."""
    with _lock:
        current = PatchStatus(_status.state, _status.deepspeed_version, _status.reason, dict(_status.methods),
                              dict(_status.changes))
        if current.state == State.APPLIED and not is_applied():
            current.state = State.CONFLICT
            current.reason = f"{TARGET_CLASS} methods were replaced by someone else after the patch applied"
        for change in OTHERS:
            if current.of(change)[0] == State.APPLIED and not _still_applied(change):
                current.changes[change.name] = (
                    State.CONFLICT, f"{TARGET_CLASS}.{', '.join(change.form_for(_loaded_class()).methods)} was "
                    "replaced by someone else after the patch applied")
        return current


def _loaded_class() -> Optional[type]:
    return getattr(sys.modules.get(TARGET_MODULE), TARGET_CLASS, None)


def originals() -> Dict[str, Callable]:
    """DeepSpeed's own functions that the applied changes replaced, by method name (a copy; empty before the patch
    applies and after ``revert()``)."""
    with _lock:
        return {name: original for record in _applied.values() for name, original in record.originals.items()}


def _still_ours(name: str) -> bool:
    """Whether method ``name`` of the loaded DeepSpeed's class is still the replacement an applied change installed."""
    cls = _loaded_class()
    return cls is not None and any(record.cls is cls and record.ours(name) for record in _applied.values())
