# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The Python interpreters the package supports, and where this machine has them.

``SUPPORTED`` is the list README's Python line, setup.py's classifiers and the ``pythons`` nox session follow; CI runs
the first and the last (``FLOOR``, ``NEWEST``). An interpreter is found as ``pythonX.Y`` on PATH when that runs (a
pyenv shim of a version that is not active does not), else under pyenv's ``versions/X.Y.*`` (``$PYENV_ROOT``, else
``pyenv root``, else ``~/.pyenv``).

    python ci/pythons.py          # each supported version and the interpreter found for it
    python ci/pythons.py 3.13     # the path of one (exit 1 when there is none)
"""

import glob
import os
import shutil
import subprocess
import sys
from typing import List, Optional

SUPPORTED = ("3.10", "3.11", "3.12", "3.13")
FLOOR, NEWEST = SUPPORTED[0], SUPPORTED[-1]


def _runs_as(path: str, version: str) -> bool:
    try:
        done = subprocess.run([path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True,
                              text=True,
                              timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and done.stdout.strip() == version


def find(version: str) -> Optional[str]:
    """The path of an interpreter of Python ``version`` (``"3.13"``) that runs, or None."""
    on_path = shutil.which(f"python{version}")
    if on_path and _runs_as(on_path, version):
        return on_path
    for root in _pyenv_roots():
        for path in sorted(glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", f"python{version}")),
                           reverse=True):
            if _runs_as(path, version):
                return path
    return None


def _pyenv_roots() -> List[str]:
    roots = [os.environ.get("PYENV_ROOT", "")]
    try:
        roots.append(subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=60).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    roots.append(os.path.expanduser("~/.pyenv"))
    return [root for root in dict.fromkeys(roots) if root]


def main() -> int:
    if len(sys.argv) > 1:
        path = find(sys.argv[1])
        if path is None:
            print(f"no Python {sys.argv[1]} here", file=sys.stderr)
            return 1
        print(path)
        return 0
    for version in SUPPORTED:
        print(f"{version}: {find(version) or 'not found'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
