# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""``ds-offload-patch run -- COMMAND``: run a command so that every Python process it starts applies the patch.

The command's environment gets the bootstrap folder (a ``sitecustomize.py``) first on PYTHONPATH. Python imports
that file at start-up in every process that inherits the environment: the ranks that ``deepspeed``, ``torchrun``
or ``accelerate launch`` spawn included. The patch is applied once per process, by importing the package.
"""

import os
import sys
from typing import Dict, List, Optional

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")


def patched_environment(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """``env`` (default: this process's) with the bootstrap folder first on PYTHONPATH, and this package's own
    folder after it when the package is not installed in site-packages (a source checkout)."""
    env = dict(os.environ if env is None else env)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [BOOTSTRAP_DIR]
    if os.path.basename(package_parent) not in ("site-packages", "dist-packages"):
        paths.append(package_parent)
    existing = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths]
    env["PYTHONPATH"] = os.pathsep.join(paths + existing)
    return env


def run(command: List[str]) -> int:
    """Replace this process with ``command`` in the patched environment. Returns only if it cannot start (127)."""
    try:
        os.execvpe(command[0], command, patched_environment())
    except OSError as exc:
        print(f"ds-offload-patch run: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        return 127
