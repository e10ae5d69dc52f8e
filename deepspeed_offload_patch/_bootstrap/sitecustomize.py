# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Imported by Python at start-up in every process whose PYTHONPATH holds this folder (``ds-offload-patch run``).

It applies the patch (the package's import is lazy: DeepSpeed is not imported here), installs the host-sync
audit when ``ds-offload-patch audit`` asked for it, and then runs the
``sitecustomize`` this one hides, if any, so a user's own start-up code keeps working.
"""

import os
import sys


def _run_hidden_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _apply() -> None:
    try:
        import deepspeed_offload_patch  # noqa: F401
    except Exception as exc:  # never stop the user's program from starting (strict mode raises at DeepSpeed's import)
        print(f"[deepspeed_offload_patch] bootstrap: the patch was not loaded: {exc!r}", file=sys.stderr)


def _audit() -> None:
    # The switch's name comes from the package's settings, loaded by _apply() (None if that import failed early).
    settings = sys.modules.get("deepspeed_offload_patch.settings")
    if settings is None or not os.environ.get(settings.AUDIT_DIR):
        return
    try:
        from deepspeed_offload_patch.audit import rank
        rank.install_from_environment()
    except Exception as exc:  # the run goes on unaudited; ``ds-offload-patch audit`` then reports no counted step
        print(f"[deepspeed_offload_patch] bootstrap: the audit was not loaded: {exc!r}", file=sys.stderr)


_apply()
_audit()
_run_hidden_sitecustomize()
