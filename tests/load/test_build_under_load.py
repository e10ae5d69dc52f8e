# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""A 2-rank job as the first user of DeepSpeed's CPU shm op, in a fresh ``TORCH_EXTENSIONS_DIR``, with every core busy
beside it: the conditions under which two ranks that both built the op lost a race in CI. ``ds-offload-patch run``
builds it once, in one process, before any rank starts (``deepspeed_offload_patch.cpu_shm``).

Not in the default suite: the build alone takes about a minute on 2 idle cores and twice that with them busy, which
is the point of the test. ``.ci/run`` runs it as a phase of its own (``python -m pytest -q tests/load``).
"""

import glob
import os
import subprocess
import sys
import time

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
