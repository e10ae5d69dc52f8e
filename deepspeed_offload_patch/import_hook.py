# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Run a callback right after a module is imported, without importing it (the shape of wrapt's post-import hooks).

Importing DeepSpeed costs seconds, so the package waits for ``deepspeed.runtime.zero.stage_1_and_2`` to be imported
by whoever needs it, then patches it before the importer gets the module back.
"""

import importlib.abc
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Callable, Optional

_lock = threading.Lock()


class _CallbackLoader(importlib.abc.Loader):
    """Delegates to the real loader; once the module has executed, removes the hook and runs its callback."""

    def __init__(self, loader, finder: "_PostImportFinder"):
        self._loader = loader
        self._finder = finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # Put the real loader back first, so the module looks exactly as it would without the hook.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        try:
            self._loader.exec_module(module)
        except BaseException as exc:
            # The importer gets its own exception, unchanged; the hook stays for a later import.
            if self._finder.on_error is not None:
                self._finder.on_error(exc)
            raise
        remove(self._finder)
        self._finder.callback(module)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the loader that the other finders return for one module name."""

    def __init__(self,
                 name: str,
                 callback: Callable[[ModuleType], None],
                 on_error: Optional[Callable[[BaseException], None]] = None):
        self.name = name
        self.callback = callback
        self.on_error = on_error
        self._searching = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or getattr(self._searching, "active", False):
            return None
        self._searching.active = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _CallbackLoader(spec.loader, self)
        return spec


def when_imported(name: str,
                  callback: Callable[[ModuleType], None],
                  on_error: Optional[Callable[[BaseException], None]] = None) -> None:
    """Call ``callback(module)`` once ``name`` is imported: now if it already is, else right after its import.

    The callback runs once. If the module fails to import, ``on_error(exception)`` runs, the importer gets the
    exception unchanged, and the hook stays for a later try. Several callbacks may wait for one module (the patch and
    ``audit`` both wait for DeepSpeed's engine): each runs; the same callback twice is one hook.
    """
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            if not any(
                    isinstance(f, _PostImportFinder) and f.name == name and f.callback == callback
                    for f in sys.meta_path):
                sys.meta_path.insert(0, _PostImportFinder(name, callback, on_error))
            return
    callback(module)


def remove(finder: _PostImportFinder) -> None:
    with _lock:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)


def cancel(name: str, callback: Optional[Callable[[ModuleType], None]] = None) -> None:
    """Remove the hooks for ``name`` that have not fired yet: the one of ``callback``, or every one."""
    with _lock:
        sys.meta_path[:] = [
            f for f in sys.meta_path if not (
                isinstance(f, _PostImportFinder) and f.name == name and (callback is None or f.callback == callback))
        ]
