# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed's CPU shm comm op as a launched job meets it (``deepspeed_offload_patch.cpu_shm``): its ``/dev/shm``
buffer files removed when the job ends, another live job's left alone; the module's commands never raise. The build
before the ranks start, in a fresh ``TORCH_EXTENSIONS_DIR`` on a loaded machine (where two ranks building it at once
lost a race in CI), is ``tests/load``'s (a minute or two of compiling: not in the default suite).
"""

import os
import subprocess
import sys

import pytest

from deepspeed_offload_patch import cpu_shm
from unit.common import assert_ok, run_command

CLI = [sys.executable, "-m", "deepspeed_offload_patch"]


def test_leftovers_are_the_new_files_that_no_process_uses(tmp_path):
    folder = str(tmp_path)
    old = tmp_path / f"{cpu_shm.BUFFER_PREFIX}0_127.0.0.1_1_0"
    old.write_bytes(b"x")
    before = cpu_shm.buffer_files(folder)
    held = tmp_path / f"{cpu_shm.BUFFER_PREFIX}0_127.0.0.1_2_0"
    left = tmp_path / f"{cpu_shm.BUFFER_PREFIX}0_127.0.0.1_2_1"
    mapped = tmp_path / f"{cpu_shm.BUFFER_PREFIX}0_127.0.0.1_2_2"
    other = tmp_path / "not_deepspeed"
    for path in (held, left, mapped, other):
        path.write_bytes(b"\0" * 4096)
    # One live process holds a file open, another maps one and closes the descriptor (as DeepSpeed's ranks do).
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(held)!r}); print('ready', flush=True); input()"],
                              stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE,
                              text=True)
    mapper = subprocess.Popen([
        sys.executable, "-c", f"import mmap\nf = open({str(mapped)!r}, 'r+b')\nm = mmap.mmap(f.fileno(), 4096)\n"
        "f.close()\nprint('ready', flush=True)\ninput()"
    ],
                              stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "ready" and mapper.stdout.readline().strip() == "ready"
        assert cpu_shm.in_use({str(held), str(left), str(mapped)}) == {str(held), str(mapped)}
        assert cpu_shm.leftovers(before, folder) == [str(left)]
    finally:
        for process in (holder, mapper):
            process.communicate("\n")
    # Once their processes are gone, both are left over; the file that was there before never is.
    assert cpu_shm.leftovers(before, folder) == sorted([str(held), str(left), str(mapped)])
    with cpu_shm.removes_leftovers(folder) as removed:
        pass
    assert removed == [] and sorted(os.listdir(folder)) == sorted(
        [old.name, held.name, left.name, mapped.name, other.name])
    with cpu_shm.removes_leftovers(folder) as removed:
        new = tmp_path / f"{cpu_shm.BUFFER_PREFIX}0_127.0.0.1_3_0"
        new.write_bytes(b"x")
    assert removed == [str(new)] and not new.exists() and held.exists() and old.exists()


def test_clean_removes_only_unused_buffer_files(tmp_path):
    """``python -m deepspeed_offload_patch.cpu_shm clean`` (what README tells a user to run) on the real folder: a
    file of a live job stays; an abandoned one goes."""
    port = 1  # no job listens on port 1: these names are this test's own
    live = os.path.join(cpu_shm.SHM_DIR, f"{cpu_shm.BUFFER_PREFIX}{os.getuid()}_127.0.0.1_{port}_0")
    dead = os.path.join(cpu_shm.SHM_DIR, f"{cpu_shm.BUFFER_PREFIX}{os.getuid()}_127.0.0.1_{port}_1")
    for path in (live, dead):
        with open(path, "wb") as f:
            f.write(b"x")
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({live!r}); print('ready', flush=True); input()"],
                              stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        output = assert_ok(run_command([sys.executable, "-m", "deepspeed_offload_patch.cpu_shm", "clean"]))
        assert dead in output and live not in output, output
        assert os.path.exists(live) and not os.path.exists(dead)
    finally:
        holder.communicate("\n")
        for path in (live, dead):
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.parametrize("action", ["build", "clean"])
def test_module_never_raises_without_deepspeed(action):
    code = ('import sys; sys.modules["deepspeed"] = None\n'
            'from deepspeed_offload_patch import cpu_shm\n'
            f'raise SystemExit(cpu_shm.main([{action!r}]))')
    output = assert_ok(run_command([sys.executable, "-c", code]))
    assert ("not needed: DeepSpeed does not import" in output) if action == "build" else ("removed" in output)


def test_a_test_that_leaves_a_buffer_file_fails(tmp_path):
    """The root conftest's check, seen from outside: a test that leaves a buffer file behind fails, and the file is
    removed."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    leaked = os.path.join(cpu_shm.SHM_DIR, f"{cpu_shm.BUFFER_PREFIX}{os.getuid()}_127.0.0.1_1_{os.getpid()}")
    folder = tmp_path / "leaks"
    folder.mkdir()
    (folder / "test_leaks.py").write_text(f"def test_leaks():\n    open({leaked!r}, 'wb').close()\n\n\n"
                                          "def test_clean():\n    pass\n")
    try:
        # The root conftest as a plugin: the test file lies outside the checkout, where it would not be collected.
        result = run_command([
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
            str(folder / "test_leaks.py")
        ],
                             env={"SHM_LEAK_GRACE_S": "0"},
                             cwd=root)
    finally:
        if os.path.exists(leaked):
            os.unlink(leaked)
            pytest.fail("the check did not remove the file it found")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "left 1 DeepSpeed shm buffer file(s)" in result.stdout and "1 error" in result.stdout, result.stdout
    assert "2 passed" in result.stdout, result.stdout
