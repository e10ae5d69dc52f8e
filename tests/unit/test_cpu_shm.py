# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed's CPU shm comm op as a launched job meets it (``deepspeed_offload_patch.cpu_shm``): built once, in one
process, before any rank starts (a fresh ``TORCH_EXTENSIONS_DIR`` on a loaded machine, where two ranks building it at
once lost a race in CI), and its ``/dev/shm`` buffer files removed when the job ends, another live job's left alone.
"""

import glob
import os
import subprocess
import sys
import time

import pytest

from deepspeed_offload_patch import cpu_shm
from unit.common import HANG_GUARD_S, assert_ok, on_free_port, run_command

CLI = [sys.executable, "-m", "deepspeed_offload_patch"]

# Each rank says whether the op was built before it started, then initializes deepspeed.comm with the op on (as a
# user's script does), says whether it loaded it and which buffer file it created, and all-reduces through it.
RANK_SCRIPT = """
import glob, os, sys
import torch
built = os.path.exists(os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "deepspeed_shm_comm", "deepspeed_shm_comm.so"))
import deepspeed
import deepspeed.comm as dist
deepspeed.init_distributed(dist_backend="gloo")
rank = dist.get_rank()
loaded = getattr(sys.modules["deepspeed.comm.comm"].cdb, "shm_comm_op", None) is not None
mine = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{os.environ['MASTER_PORT']}_{rank}")
total = torch.ones(4)
dist.all_reduce(total)
print(f"rank {rank}: built-before-start={built} loaded={loaded} buffer={len(mine)} sum={total[0].item():.0f}",
      flush=True)
# Ended as a well-behaved script ends: a rank that exits with the process group alive can abort in its teardown on a
# loaded machine ("terminate called without an active exception", SIGABRT after the job's work is done).
dist.destroy_process_group()
"""


def _hog() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True:\n    pass"])


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


def test_run_builds_the_op_once_before_the_ranks_and_removes_the_jobs_buffer_files(tmp_path):
    """``ds-offload-patch run -- torchrun --nproc_per_node 2`` in a fresh ``TORCH_EXTENSIONS_DIR``, with both cores
    busy beside it (the CI failure's conditions): every rank finds the op built before it starts (without ``run``'s
    build, both ranks would go to build it, the race CI lost), loads it, creates its buffer file, and the job leaves
    ``/dev/shm`` without a file of its own (its port names them; another suite's jobs may come and go beside it)."""
    (tmp_path / "script.py").write_text(RANK_SCRIPT)
    extensions = tmp_path / "torch_extensions"
    env = {
        "LOCAL_SIZE": "2",
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "TORCH_EXTENSIONS_DIR": str(extensions),
        "OMP_NUM_THREADS": "1",
    }
    job = on_free_port(["torchrun", "--nproc_per_node", "2", "script.py"])
    port = job[job.index("--master_port") + 1]
    hogs = [_hog() for _ in range(os.cpu_count() or 2)]
    started = time.monotonic()
    try:
        result = run_command(CLI + ["run", "--", *job], env=env, cwd=tmp_path, timeout=HANG_GUARD_S)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    output = assert_ok(result)
    for rank in (0, 1):
        assert f"rank {rank}: built-before-start=True loaded=True buffer=1 sum=2" in output, output
    assert "deepspeed_shm_comm of DeepSpeed" in result.stderr and "ready in" in result.stderr, result.stderr
    assert glob.glob(str(extensions / "deepspeed_shm_comm" / "*.so")), "the op was not built where the job said"
    left = [path for path in cpu_shm.buffer_files() if f"_{port}_" in os.path.basename(path)]
    assert not left, f"the job left DeepSpeed shm buffer files behind: {left}"
    print(f"fresh build and 2-rank job beside {len(hogs)} busy processes: {time.monotonic() - started:.0f} s")


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
