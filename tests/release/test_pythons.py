# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The fingerprints are a function of the code alone: every supported Python (``ci/pythons.py``) regenerates
``deepspeed_offload_patch/fingerprints.py`` from the 47 releases' sdists byte for byte, and digests the package's
own replacements as recorded in ``OWN``.

Each interpreter runs ``ci/gen_fingerprints.py`` itself, with only ``packaging`` and ``yapf`` installed for it into a
scratch folder (``pip install --target``): no torch, no DeepSpeed. Not in the default suite (it reads the sdists, as
``test_sources.py`` does). An interpreter this machine lacks is skipped, unless ``DS_OFFLOAD_PATCH_ALL_PYTHONS=1``
(``.ci/run`` sets it), where a missing one fails.
"""

import os
import subprocess
import sys

import pytest

from deepspeed_offload_patch import settings
from unit.common import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SDISTS = os.environ.get("DS_OFFLOAD_PATCH_SDISTS", os.path.expanduser("~/.cache/ds-offload-patch/sdists"))
SHIPPED = os.path.join(ROOT, "deepspeed_offload_patch", "fingerprints.py")
CONSTRAINTS = os.path.join(ROOT, "ci", "constraints.txt")  # the pinned test environment (ci/pin.py)
sys.path.insert(0, os.path.join(ROOT, "ci"))

from pythons import SUPPORTED, find  # noqa: E402


def _interpreter(version: str) -> str:
    path = find(version)
    if path is None:
        if os.environ.get(settings.ALL_PYTHONS) == "1":
            pytest.fail(f"Python {version} is not on this machine (ci/pythons.py), and {settings.ALL_PYTHONS}=1")
        pytest.skip(f"Python {version} is not on this machine")
    return path


def _tools_for(python: str, folder) -> dict:
    """An environment in which ``python`` (a bare interpreter) imports the generator's two dependencies."""
    site = folder / "site"
    done = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "-c", CONSTRAINTS, "--target",
         str(site), "packaging", "yapf"],
        capture_output=True,
        text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(os.environ, PYTHONPATH=str(site), PYTHONNOUSERSITE="1")


@pytest.mark.parametrize("version", SUPPORTED)
def test_every_python_writes_the_same_fingerprints(version, tmp_path):
    python = _interpreter(version)
    env = _tools_for(python, tmp_path)
    table = tmp_path / "fingerprints.py"
    result = run_command([python, "ci/gen_fingerprints.py", "--sdists", SDISTS, "--table",
                          str(table)],
                         cwd=ROOT,
                         env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(SHIPPED) as f:
        assert table.read_text() == f.read(), f"Python {version} regenerates another fingerprints.py"
    # The guard on that interpreter also finds its reading of the package's own code to be the recorded one.
    probe = ("import sys; from deepspeed_offload_patch import guard; from deepspeed_offload_patch.changes import "
             "CHANGES; problem = next(filter(None, map(guard.interpreter_problem, CHANGES)), None); "
             "print(problem or 'same'); sys.exit(1 if problem else 0)")
    result = run_command([python, "-c", probe], cwd=ROOT, env=dict(env, DS_OFFLOAD_PATCH_DISABLE="1"))
    assert result.returncode == 0 and "same" in result.stdout, result.stdout + result.stderr
