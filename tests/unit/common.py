# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""A small ``DistributedTest`` in the shape of DeepSpeed's: each test method runs on ``world_size`` spawned ranks.

A subclass sets ``world_size`` (and ``timeout``, in seconds); ``tests/conftest.py`` runs every test method of it
through :func:`run_distributed_test`. Ranks rendezvous through a ``file://`` store, see LOCAL_SIZE, fail together,
and a rank that hangs is named.

Every limit here is a guard against a hang (``HANG_GUARD_S``, far above the slowest correct run measured on 2 busy
cores with cold caches), never a budget: a slow machine is not failed by it, and a limit that fires names the command
and the time it had.
"""

import functools
import importlib.util
import os
import subprocess
import sys
import textwrap
from typing import Any, Dict, List, Optional

import pytest

from deepspeed_offload_patch.testing.launch import HANG_GUARD_S, free_port, run_distributed


class DistributedTest:
    world_size = 2
    timeout = HANG_GUARD_S


def _call_method(cls: type, name: str, kwargs: Dict[str, Any]) -> None:
    getattr(cls(), name)(**kwargs)


def run_distributed_test(cls: type, name: str, kwargs: Dict[str, Any]) -> None:
    run_distributed(_call_method, cls.world_size, args=(cls, name, kwargs), timeout=cls.timeout, fork_server=True)


def clean_env(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """This process's environment without its ``DS_OFFLOAD_PATCH_*`` switches, plus ``env``."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("DS_OFFLOAD_PATCH_")}
    child_env.update(env or {})
    return child_env


def run_command(args: List[str],
                env: Optional[Dict[str, str]] = None,
                timeout: float = HANG_GUARD_S,
                **kwargs) -> subprocess.CompletedProcess:
    """Run ``args`` in the :func:`clean_env` environment, capturing text output.

    Raises:
        AssertionError: the command did not finish within ``timeout`` seconds (a hang guard); the message names the
            command, the limit and what it had printed.
    """
    try:
        return subprocess.run(args, env=clean_env(env), capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as exc:
        printed = "\n".join((part.decode(errors="replace") if isinstance(part, bytes) else part)[-4000:]
                            for part in (exc.stdout, exc.stderr) if part)
        raise AssertionError(f"hang guard: {' '.join(map(str, args))[:300]} did not finish within {timeout:.0f} s; "
                             f"it printed:\n{printed}") from None


def run_python(code: str,
               env: Optional[Dict[str, str]] = None,
               timeout: float = HANG_GUARD_S) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (see :func:`run_command`).

    Import-order and lifecycle tests need a process where neither package has been imported yet.
    """
    return run_command([sys.executable, "-c", textwrap.dedent(code)], env=env, timeout=timeout)


def assert_ok(result: subprocess.CompletedProcess) -> str:
    """Assert the child exited 0; return its output, stdout then stderr (DeepSpeed's logger writes to stdout)."""
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout + result.stderr


@functools.lru_cache(maxsize=None)
def shm_op_built() -> str:
    """Build DeepSpeed's CPU shm comm op once per test session, in one process, before a test launches ranks that
    load it themselves (a launcher started without ``ds-offload-patch run``/``audit``, which build it first): two ranks
    that both find it unbuilt race to build it, and on a loaded machine one loads it before the other has written it.
    Returns what the build said; fails the test if it failed."""
    return assert_ok(run_command([sys.executable, "-m", "deepspeed_offload_patch.cpu_shm", "build"]))


LAUNCHERS = ("deepspeed", "torchrun")


def on_free_port(command: List[str]) -> List[str]:
    """``command`` with ``--master_port`` set to a free port right after its launcher (``deepspeed`` or ``torchrun``,
    by base name). Both default to 29500: two jobs on one machine (this suite beside another, or beside CI) on that
    port collide (``EADDRINUSE``) and would share DeepSpeed's shm buffer names, which carry the port. A command
    without either launcher is returned unchanged."""
    for index, arg in enumerate(command):
        if os.path.basename(str(arg)) in LAUNCHERS:
            return [*command[:index + 1], "--master_port", str(free_port()), *command[index + 1:]]
    return list(command)


def synthetic_class(tmp_path, name: str, body: str, header: str = "", class_name: str = "DeepSpeedZeroOptimizer"):
    """``class_name`` of a module ``name`` written under ``tmp_path`` as ``header`` and the class with ``body`` (its
    methods' text, dedented here) and imported: its methods' source is real and readable, as DeepSpeed's is, so the
    guard fingerprints it and finds it defined in the class's own file."""
    path = tmp_path / f"{name}.py"
    path.write_text(header + f"\n\nclass {class_name}:\n" + textwrap.indent(textwrap.dedent(body), "    "))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return getattr(module, class_name)


def fails_unpatched_if(condition: bool):
    """``pytest.mark.fails_unpatched`` where ``condition`` holds (the installed release has the defect that makes the
    test fail unpatched), else a decorator that leaves the test as it is."""
    return pytest.mark.fails_unpatched if condition else (lambda test: test)
