# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""``ds-offload-patch run -- COMMAND``: run a command so that every Python process it starts applies the patch.

The command's environment gets the bootstrap folder (a ``sitecustomize.py``) first on PYTHONPATH. Python imports
that file at start-up in every process that inherits the environment: the ranks that ``deepspeed``, ``torchrun``
or ``accelerate launch`` spawn included. The patch is applied once per process, by importing the package.

On several nodes, DeepSpeed's multi-node runner (pdsh and the others) gives the remote ranks only the variables whose
names start with ``PYTHON`` (PYTHONPATH, so the bootstrap, included) and the lines of a ``.deepspeed_env`` file. A
``PYTHONPATH=`` line there replaces the exported one on every node, and then no rank finds the bootstrap: nothing of
this package runs in them, so they cannot say so themselves. :func:`deepspeed_env_problems` finds such a line before
the launch, and ``run`` prints it with the line that fixes it.
"""

import os
import signal
import subprocess
import sys
from typing import Dict, List, Optional

from deepspeed_offload_patch import cpu_shm

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")
#: The file of ``DS_OFFLOAD_PATCH_*`` variables that ``ds-offload-patch audit`` puts in a folder on PYTHONPATH; the
#: bootstrap, which cannot import this module before setting them, spells the same name.
FORWARDED_ENV_FILE = "ds-offload-patch-env.json"
#: DeepSpeed's runner: the file it reads (name from ``DS_ENV_FILE``), in the home folder and the current one.
DEEPSPEED_ENV_FILE = ".deepspeed_env"
#: How a command names DeepSpeed's runner (its console scripts and its module).
DEEPSPEED_RUNNERS = ("deepspeed", "ds", "deepspeed.launcher.runner")


def bootstrap_path() -> List[str]:
    """The PYTHONPATH entries that apply the patch: the bootstrap folder, and this package's own parent folder when
    the package is not installed in site-packages (a source checkout)."""
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [BOOTSTRAP_DIR]
    if os.path.basename(package_parent) not in ("site-packages", "dist-packages"):
        paths.append(package_parent)
    return paths


def patched_environment(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """``env`` (default: this process's) with :func:`bootstrap_path` first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    paths = bootstrap_path()
    existing = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths]
    env["PYTHONPATH"] = os.pathsep.join(paths + existing)
    return env


def deepspeed_env_problems(command: List[str],
                           env: Optional[Dict[str, str]] = None,
                           cwd: Optional[str] = None) -> List[str]:
    """What keeps the bootstrap from the ranks DeepSpeed's multi-node runner starts with ``command``: one message per
    ``.deepspeed_env`` file (``$DS_ENV_FILE`` if set, in ``~`` and in ``cwd``, as the runner reads them) whose
    ``PYTHONPATH=`` line leaves out the bootstrap folder, naming the file and the line that fixes it. Empty when the
    command does not start DeepSpeed's runner (other launchers pass PYTHONPATH on by themselves). Never raises: an
    unreadable file is no finding."""
    if not any(os.path.basename(arg) in DEEPSPEED_RUNNERS for arg in command[:3]):
        return []
    env = dict(os.environ if env is None else env)
    name = env.get("DS_ENV_FILE", DEEPSPEED_ENV_FILE)
    problems = []
    seen = set()
    for folder in (os.path.expanduser("~"), cwd or os.getcwd()):
        path = os.path.abspath(os.path.join(folder, name))
        if path in seen or not os.path.isfile(path):
            continue
        seen.add(path)
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition("=")
            if key.strip() != "PYTHONPATH":
                continue
            entries = [p for p in value.strip().strip('"').split(os.pathsep) if p]
            if BOOTSTRAP_DIR in entries:
                continue
            fixed = os.pathsep.join(bootstrap_path() + [p for p in entries if p not in bootstrap_path()])
            problems.append(f"{path} sets PYTHONPATH, which DeepSpeed's multi-node runner exports to every node in "
                            f"place of the one that carries the patch's bootstrap: the ranks it starts will not be "
                            f"patched, and cannot say so. Fix that line (the same install path on every node):\n"
                            f"PYTHONPATH={fixed}\n"
                            f"or import deepspeed_offload_patch in the training script")
    return problems


def launch(command: List[str], env: Dict[str, str], prefix: str) -> int:
    """Run ``command`` with ``env`` and return its exit code (127 if it cannot start), as a job on the CPU
    accelerator needs it: DeepSpeed's CPU shm op is built first, in one process (this interpreter, this process's
    own environment), so that the ranks only load it (:func:`cpu_shm.build_op_in_subprocess`; a failed build is one
    line on stderr and the ranks build it as they would have); afterwards the ``/dev/shm`` buffer files the job's
    ranks created and left are removed. SIGTERM (a CI runner's timeout or cancel) and Ctrl-C go on to the command,
    whose launcher stops its ranks. A command killed by signal N gives 128 + N."""
    cpu_shm.build_op_in_subprocess(prefix=prefix)
    with cpu_shm.removes_leftovers():
        try:
            process = subprocess.Popen(command, env=env)
        except OSError as exc:
            print(f"{prefix}: cannot run {command[0]!r}: {exc}", file=sys.stderr)
            return 127
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: process.send_signal(signum))
        try:
            while True:
                try:
                    code = process.wait()
                    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says
                except KeyboardInterrupt:
                    process.send_signal(signal.SIGINT)
        finally:
            signal.signal(signal.SIGTERM, previous)


def run(command: List[str]) -> int:
    """Run ``command`` in the patched environment through :func:`launch`, after printing to stderr each of
    :func:`deepspeed_env_problems`; returns the command's exit code (127 if it cannot start)."""
    for problem in deepspeed_env_problems(command):
        print(f"ds-offload-patch run: warning: {problem}", file=sys.stderr, flush=True)
    return launch(command, patched_environment(), "ds-offload-patch run")
