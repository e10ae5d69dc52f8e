# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Applies and reverts the patch: the registry of originals, the lazy hooks, the state that ``status()`` reports.

Each change names the class it replaces methods of, or sets a config default of
(:class:`~deepspeed_offload_patch.changes.record.Target`); the patcher hooks each target's module and applies, as that
module is imported, the changes that target it. The upstream change's class (ZeRO-1/2's) gives ``status()``'s
``state``; a change on another class (ZeRO-3's, the bf16 config's) keeps its own state in ``status().changes`` and
stays ``pending`` until its module is imported.
"""

import importlib
import sys
import threading
from types import ModuleType
from typing import Callable, Dict, Mapping, Optional, Tuple

from deepspeed_offload_patch import import_hook, settings, skip_log
from deepspeed_offload_patch.changes import CHANGES, OTHERS, UPSTREAM, by_name, targets
from deepspeed_offload_patch.changes.record import Change, Target
from deepspeed_offload_patch.guard import version_refused
from deepspeed_offload_patch.log import info_once, warn_once
# AppliedPatch: re-exported (patcher.AppliedPatch).
from deepspeed_offload_patch.replacements import (
    AppliedPatch,
    as_decorated,
    settle_live_flags,
    subclasses,
    warn_if_overriding,  # noqa: F401
    watch_subclasses)
# PatchStatus and deepspeed_version: re-exported (deepspeed_offload_patch.PatchStatus; patcher.deepspeed_version).
from deepspeed_offload_patch.patch_status import (  # noqa: F401
    PatchStatus, deepspeed_installed, deepspeed_lacks, deepspeed_version)
# GOOD_STATES: re-exported by the package (deepspeed_offload_patch.GOOD_STATES).
from deepspeed_offload_patch.states import GOOD_STATES, State  # noqa: F401

#: The upstream change's class, whose import decides the package's own state.
TARGET_MODULE = UPSTREAM.target.module
TARGET_CLASS = UPSTREAM.target.name


class PatchError(RuntimeError):
    """The patch cannot apply and strict mode (``DS_OFFLOAD_PATCH_STRICT=1``) asks for an error."""


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
    conflict; a release that every change refuses is said once, for the patch); nothing for other states. Raises
    PatchError instead of that WARNING when ``strict``."""
    if state == State.APPLIED:
        info_once(f"{what}: applied: {reason}")
    elif state in (State.UPSTREAM_FIXED, State.NOT_NEEDED):
        info_once(f"{what}: not needed: {reason}")
    elif state in (State.UNSUPPORTED, State.CONFLICT):
        if reason == version_refused(deepspeed_version() or "unknown"):
            what = "the patch"  # every change refuses this release: one line, whichever module is imported first
        message = f"{what} not applied ({state}): {reason}; DeepSpeed is left unchanged"
        if strict:
            raise PatchError(message)
        warn_once(message)


def _apply_change(cls: type, change: Change):
    """Let the change decide on its methods of ``cls`` and install its replacements if it says so."""
    decision = change.decide(change, cls, deepspeed_version() or "unknown")
    if decision.replacements:
        originals = {name: cls.__dict__[name] for name in decision.replacements}
        record = AppliedPatch(change.name, cls, originals, {
            name: as_decorated(originals[name], replacement)
            for name, replacement in decision.replacements.items()
        })
        _applied[change.name] = record
        for name, replacement in record.replacements.items():
            setattr(cls, name, replacement)
        if change.default is None:  # a default has no method for a subclass to override
            for sub in subclasses(cls):
                warn_if_overriding(sub, _applied.values())
            record.subclass_watch = watch_subclasses(cls, _applied.values)
    return decision


def _target_of(module_name: str) -> Target:
    return next(target for target in targets() if target.module == module_name)


def _patch_module(module: ModuleType, strict: bool, on: Mapping[str, bool]) -> PatchStatus:
    """Apply to the loaded module the changes that target its class: the upstream change (when it is ZeRO-1/2's
    module) and each other change that ``on`` (by name) switches on."""
    target = _target_of(module.__name__)
    ours = [change for change in CHANGES if change.target == target]
    with _lock:
        cls = getattr(module, target.name, None)
        found, methods = {}, {}
        for change in ours:
            if not (change.upstream or on[change.name]):
                found[change.name] = _left_out(change)
            elif cls is None:
                found[change.name] = (State.UNSUPPORTED, f"{target.module} has no {target.name}")
            else:
                decision = _apply_change(cls, change)
                methods.update({change.key(name): result for name, result in decision.methods.items()})
                found[change.name] = (decision.state, decision.reason)
        # The findings of the other classes' methods stay as their own modules' hooks left them.
        mine = {change.key(name) for change in ours for name in change.method_names}
        methods = {**{key: finding for key, finding in _status.methods.items() if key not in mine}, **methods}
        if UPSTREAM.name in found:
            status = _set(*found.pop(UPSTREAM.name), methods, others=found)
            _log_or_raise(UPSTREAM.title, status.state, status.reason, strict)
        else:
            status = _set(_status.state, _status.reason, methods, others=found)
    # One message per cause: a DeepSpeed that the changes refuse for the same reason (its version) is said once.
    for change in ours:
        if not change.upstream and on[change.name] and status.of(change) != (status.state, status.reason):
            _log_or_raise(change.title, *status.of(change), strict)
    return status


def _left_out(change: Change) -> tuple:
    """The state of a change that its switch (or ``UPSTREAM_ONLY``, or being opt-in) leaves out."""
    if settings.upstream_only():
        return (State.OFF, f"{settings.UPSTREAM_ONLY}: left out")
    if settings.off_as_by_default(change):
        return (State.OFF, f"opt-in: {change.opt_in} ({change.switch}=1 turns it on)")
    return (State.OFF, f"{change.switch}=0: left out")


def _switched_on() -> Dict[str, bool]:
    """Whether each other change is on, by name, as the switches say."""
    return {change.name: settings.change_on(change) for change in OTHERS}


def _restore() -> None:
    """Put back every original whose attribute is still ours, on every class, and forget every applied set."""
    if not _applied:
        return
    # Newest first: a class two changes hooked gets its own __init_subclass__ state back in order.
    for record in reversed(list(_applied.values())):
        for name, original in record.originals.items():
            if record.ours(name):
                setattr(record.cls, name, original)
            else:
                warn_once(f"revert: {record.cls.__name__}.{name} was replaced by someone else after the patch; left "
                          "as is")
        watch = record.subclass_watch
        if watch is not None and record.cls.__dict__.get("__init_subclass__") is watch:
            del record.cls.__init_subclass__
    _applied.clear()
    cls = _loaded_class(UPSTREAM.target)
    if cls is not None:
        settle_live_flags(cls)


def _target_failed(exc: BaseException, target: Target = UPSTREAM.target) -> PatchStatus:
    """Record that ``target``'s module failed to import: the package's state when it is the upstream change's module,
    else the state of each change on that class that is switched on; one WARNING each."""
    reason = (f"{target.module} failed to import ({type(exc).__name__}: {exc}); the patch applies when an import of "
              "it succeeds")
    if target == UPSTREAM.target:
        status = _set(State.UNSUPPORTED, reason)
        _log_or_raise(UPSTREAM.title, status.state, status.reason, strict=False)
        return status
    on = _switched_on()
    failed = [change for change in OTHERS if change.target == target and on[change.name]]
    status = _set(_status.state, _status.reason, _status.methods,
                  {c.name: (State.UNSUPPORTED, reason)
                   for c in failed})
    for change in failed:
        _log_or_raise(change.title, State.UNSUPPORTED, reason, strict=False)
    return status


def _on_target_import_error(exc: BaseException, target: Target = UPSTREAM.target) -> None:
    """The lazy hook, when a target module fails to import: say so once. The importer gets DeepSpeed's own
    exception, unchanged (strict mode adds nothing to it)."""
    if isinstance(exc, Exception):
        with _lock:
            _target_failed(exc, target)


def _error_hook(target: Target) -> Callable[[BaseException], None]:
    return lambda exc: _on_target_import_error(exc, target)


def _on_target_import(module: ModuleType) -> None:
    """The lazy hook: patch as DeepSpeed's ZeRO module is imported. Never breaks that import unless strict."""
    strict = settings.strict()
    try:
        _patch_module(module, strict, _switched_on())
    except PatchError:
        raise
    except Exception as exc:  # a bug here must not stop training
        _restore()
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
        _pend_other_targets()
        for target in targets():
            import_hook.when_imported(target.module, _on_target_import, _error_hook(target))
        if settings.skip_log_on():
            import_hook.when_imported(skip_log.MODULE, skip_log.install)
        return _status


def _before_import(change: Change, on: bool) -> tuple:
    """The state of a change on a class other than the upstream one before its module is imported: its ``off`` when
    not ``on``, ``not-needed`` where this DeepSpeed has no such module (an optional one), else ``pending``."""
    if not on:
        return _left_out(change)
    if change.target.optional and deepspeed_lacks(change.target.module):
        return (State.NOT_NEEDED, f"DeepSpeed {deepspeed_version()} has no {change.target.module}: nothing of "
                f"{change.title} to change")
    return (State.PENDING, f"waiting for {change.target.module} to be imported")


def _pend_other_targets() -> None:
    """Give each change on a class other than the upstream one whose module is not imported yet its state
    (:func:`_before_import`): its own hook decides when the module is imported."""
    on = _switched_on()
    _set(
        _status.state, _status.reason, _status.methods, {
            change.name: _before_import(change, on[change.name])
            for change in OTHERS if change.target != UPSTREAM.target and change.target.module not in sys.modules
        })


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
    on = {**_switched_on(), **(changes or {})}
    status = _status
    for target in targets():
        if target.optional and deepspeed_lacks(target.module):
            with _lock:
                status = _set(_status.state, _status.reason, _status.methods,
                              {c.name: _before_import(c, on[c.name])
                               for c in OTHERS if c.target == target})
            continue
        # Imported outside the lock: the import takes Python's module lock, and the lazy hook, which may run inside
        # that import on this or another thread, takes ours.
        try:
            module = importlib.import_module(target.module)
        except Exception as exc:
            with _lock:
                status = _target_failed(exc, target)
            if settings.strict():
                titles = [c.title for c in CHANGES if c.target == target and (c.upstream or on[c.name])]
                raise PatchError(f"{', '.join(titles)} not applied: {target.module} failed to import "
                                 f"({type(exc).__name__}: {exc})") from exc
            if target == UPSTREAM.target:
                return status
            continue
        with _lock:
            import_hook.cancel(target.module)
            status = _patch_module(module, settings.strict(), on)
    if settings.skip_log_on():
        skip_log.install(importlib.import_module(skip_log.MODULE))
    return status


def revert() -> PatchStatus:
    """Put DeepSpeed's original methods back (the same function objects), where the attribute is still ours.

    A method that someone replaced after the patch is left as it is, with a warning. A pending lazy patch is
    cancelled. Live optimizers use the originals from their next call on.
    """
    with _lock:
        pending = [change.name for change in OTHERS if _status.of(change)[0] == State.PENDING]
        for target in targets():
            import_hook.cancel(target.module)
        import_hook.cancel(skip_log.MODULE, skip_log.install)
        skip_log.uninstall()
        if not _applied:
            cancelled = (State.REVERTED, "the pending patch was cancelled")
            if _status.state == State.PENDING:
                return _set(*cancelled, others=dict.fromkeys(pending, cancelled))
            return _set(_status.state, _status.reason, _status.methods, dict.fromkeys(pending, cancelled))
        had = [change.name for change in OTHERS if _status.of(change)[0] == State.APPLIED]
        _restore()
        restored = (State.REVERTED, "revert() restored DeepSpeed's original method")
        return _set(State.REVERTED,
                    "revert() restored DeepSpeed's original methods",
                    others=dict.fromkeys(had, restored))


def is_applied() -> bool:
    """True when the upstream change's methods (in the form the loaded DeepSpeed has) are this package's replacements
    right now (the other changes aside)."""
    return _still_applied(UPSTREAM)


def _still_applied(change: Change) -> bool:
    """Whether what ``change`` installed on its loaded class (its methods, or the attributes that carry its default)
    is all still there."""
    record = _applied.get(change.name)
    return (record is not None and record.cls is _loaded_class(change.target)
            and all(_still_ours(change, name) for name in record.replacements))


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
                methods = () if change.default else change.form_for(_loaded_class(change.target)).methods
                what = f"{change.default.field}'s default" if change.default else ", ".join(methods)
                current.changes[change.name] = (State.CONFLICT, f"{change.target.name}.{what} was replaced by someone "
                                                "else after the patch applied")
        return current


def _loaded_class(target: Target = UPSTREAM.target) -> Optional[type]:
    return getattr(sys.modules.get(target.module), target.name, None)


def originals() -> Dict[str, Callable]:
    """DeepSpeed's own functions that the applied changes replaced, by method key (the bare name on ZeRO-1/2's class,
    ``Class.name`` on another: :meth:`~deepspeed_offload_patch.changes.record.Target.key`); a copy, empty before the
    patch applies and after ``revert()``."""
    with _lock:
        return {
            by_name(record.change).key(name): original
            for record in _applied.values() if by_name(record.change).default is None
            for name, original in record.originals.items()
        }


def _still_ours(change: Change, name: str) -> bool:
    """Whether method ``name`` of ``change``'s loaded class is still the replacement an applied change installed."""
    cls = _loaded_class(change.target)
    return cls is not None and any(record.cls is cls and record.ours(name) for record in _applied.values())
