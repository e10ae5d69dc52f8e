# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""What ``status()`` reports (:class:`PatchStatus`), and the DeepSpeed it is about, found without importing it."""

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from deepspeed_offload_patch.changes import OTHERS
from deepspeed_offload_patch.changes.record import Change
from deepspeed_offload_patch.states import State


@dataclass
class PatchStatus:
    """Where the patch stands in this process.

    ``state`` and ``reason`` are the upstream change's (the overflow flag on the device): one of applied, pending
    (DeepSpeed's ZeRO module is not imported yet; the patch applies when it is), upstream-fixed, unsupported,
    conflict, disabled, deepspeed-missing, reverted or not-applied (before the package's import has run). ``methods``
    maps each examined method to the guard's finding (see :mod:`deepspeed_offload_patch.guard`). ``changes`` holds
    each other change's ``(state, reason)`` by name (:data:`deepspeed_offload_patch.changes.OTHERS`), decided with the
    upstream change: off (its switch left it out), applied, not-needed (the DeepSpeed has no such defect),
    upstream-fixed, unsupported, conflict or reverted. Until they are decided, :meth:`of` gives the upstream
    change's state. Each is also read
    as the attributes named by its record's keys in ``status --json`` (``state_key``, ``reason_key``).
    """

    state: State
    deepspeed_version: Optional[str]
    reason: str
    methods: Dict[str, str] = field(default_factory=dict)
    changes: Dict[str, Tuple[State, str]] = field(default_factory=dict)

    def of(self, change: Change) -> Tuple[State, str]:
        """``(state, reason)`` of ``change``. A change not decided on in this process shares the upstream change's
        state (pending, disabled, deepspeed-missing, not-applied: whatever kept the patch from deciding), with no
        reason of its own; ``off`` is only ever its switch's doing."""
        if change.upstream:
            return self.state, self.reason
        return self.changes.get(change.name, (self.state, ""))

    def as_dict(self) -> dict:
        """The status as ``status --json`` writes it: each change's state and reason under its record's keys."""
        found = {
            "state": self.state,
            "deepspeed_version": self.deepspeed_version,
            "reason": self.reason,
            "methods": dict(self.methods)
        }
        for change in OTHERS:
            found[change.state_key], found[change.reason_key] = self.of(change)
        return found

    def __getattr__(self, name: str):
        if not name.startswith("_") and name != "changes":
            for change in OTHERS:
                if name in (change.state_key, change.reason_key):
                    return self.of(change)[name == change.reason_key]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


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


def deepspeed_lacks(module: str) -> bool:
    """Whether the installed DeepSpeed has no module ``module`` (a ``deepspeed.`` dotted name), found by looking at
    its package folder, without importing DeepSpeed. False when DeepSpeed is not installed or has no folder."""
    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        return False
    folders = list(spec.submodule_search_locations or ()) if spec else []
    parts = module.split(".")[1:]
    return bool(folders) and not any(
        os.path.isfile(os.path.join(folder, *parts) + ".py") or os.path.isdir(os.path.join(folder, *parts))
        for folder in folders)
