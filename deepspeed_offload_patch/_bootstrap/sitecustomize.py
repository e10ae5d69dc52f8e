# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Imported by Python at start-up in every process whose PYTHONPATH holds this folder (``ds-offload-patch run``).

It applies the patch (the package's import is lazy: DeepSpeed is not imported here), installs the host-sync
audit when ``ds-offload-patch audit`` asked for it, and then runs the
``sitecustomize`` this one hides, if any, so a user's own start-up code keeps working.

``ds-offload-patch audit`` also puts a folder holding :data:`FORWARDED_ENV` (its ``DS_OFFLOAD_PATCH_*`` settings)
first on PYTHONPATH: launchers that pass only PYTHONPATH to other nodes (DeepSpeed's multi-node runner) then carry
the audit and its switches to every rank that can read that folder. When the package cannot be imported here, one
line on stderr names this rank and host and what to do.
"""

import json
import os
import sys

#: The file ``ds-offload-patch audit`` writes into a folder on PYTHONPATH: ``{name: value}`` of the variables to set
#: (``launcher.FORWARDED_ENV_FILE``; importing that module here would apply the patch before they are set).
FORWARDED_ENV = "ds-offload-patch-env.json"


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


def _forwarded_environment() -> None:
    """Set the ``DS_OFFLOAD_PATCH_*`` variables of the first :data:`FORWARDED_ENV` on PYTHONPATH (they override: the
    audit's run decides its switches on every node). Anything unreadable is ignored."""
    for folder in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        path = os.path.join(folder, FORWARDED_ENV) if folder else ""
        if not path or not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                variables = json.load(f)
            # The prefix is spelled out: importing the package's settings would apply the patch before they are set.
            os.environ.update({k: str(v) for k, v in variables.items() if k.startswith("DS_OFFLOAD_PATCH_")})
        except (OSError, ValueError, AttributeError):
            pass
        return


def _apply() -> None:
    try:
        import deepspeed_offload_patch  # noqa: F401
    except Exception as exc:  # never stop the user's program from starting (strict mode raises at DeepSpeed's import)
        import socket
        who = f"rank {os.environ['RANK']}" if "RANK" in os.environ else f"process {os.getpid()}"
        # One write: the ranks of a node share the launcher's stderr, and print() writes its end separately.
        sys.stderr.write(
            f"[deepspeed_offload_patch] bootstrap: {who} on {socket.gethostname()}: the patch was not "
            f"loaded: {exc!r}. It runs unpatched. Install deepspeed-offload-patch in this node's Python "
            f"({sys.executable}) at the path the launching node has, or import deepspeed_offload_patch in "
            f"the training script\n")
        sys.stderr.flush()


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


_forwarded_environment()
_apply()
_audit()
_run_hidden_sitecustomize()
