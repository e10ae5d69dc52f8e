# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The 8-rank training job of ``test_eight_ranks.py``: 2 nodes x 4 ranks, 4 data-parallel x 2 model-parallel ranks
with a Megatron-shaped ``mpu`` (``deepspeed_offload_patch.testing.models.ModelParallelGroups``: model-parallel groups
[0, 1], [2, 3], [4, 5], [6, 7], data-parallel groups [0, 2, 4, 6] and [1, 3, 5, 7], so every data-parallel group
spans both nodes), ZeRO-1 and ZeRO-2 with the optimizer offloaded to the CPU, bf16 (check on) and fp16 (dynamic loss
scaling). Each of the 4 runs (:data:`RUNS`) trains 3 optimizer steps with gradient accumulation 2 and one inf or NaN
in one micro-batch's gradient on one rank.

It imports the package first, as a training script does; whether the patch applies is the
``DS_OFFLOAD_PATCH_DISABLE`` that ``.deepspeed_env`` gives every rank. Each rank writes into ``--out``:

* ``rank-<RANK>.pkl``: the full trace of :func:`deepspeed_offload_patch.testing.equivalence.trace_runs` (per step
  the overflow flag, the bits of the parameters and fp32 master partitions, the skipped steps, the loss scale, the
  gradient norm, ``optimizer.overflow``; the host syncs counted in each boundary backward; the groups), plus the
  node and host, for a bit-for-bit comparison;
* ``rank-<RANK>.json``: the same in short for a reader: state, node, and per run the host syncs per boundary
  backward, the skipped-step count and a sha256 of the parameters after each step.

    deepspeed --hostfile HOSTFILE --master_addr 127.0.0.1 ... eight_ranks_train.py --out FOLDER

A rank that fails raises (the launcher's exit code says so); nothing is written for it.
"""

import argparse
import hashlib
import json
import os
import pickle
import socket
import sys
from typing import Any, Dict, List, Optional

# The import route: this patches DeepSpeed unless DS_OFFLOAD_PATCH_DISABLE=1.
import deepspeed_offload_patch  # noqa: F401
from deepspeed_offload_patch.testing.equivalence import Fault, Run

WORLD = 8
MODEL_PARALLEL = 2
STEPS = 3
NUM_TENSORS = 8
FAULT_STEP = 1


def _run(stage: int, precision: str, fault: Fault) -> Run:
    return Run(f"s{stage}-{precision}",
               stage=stage,
               precision=precision,
               grad_accum=2,
               steps=STEPS,
               num_tensors=NUM_TENSORS,
               world_size=WORLD,
               model_parallel=MODEL_PARALLEL,
               faults=(fault, ))


#: ZeRO-1/2 x bf16/fp16, one fault each, on ranks of both nodes (0-3: node-a, 4-7: node-b), at the boundary micro-batch
#: (``micro=None``) or the inner one (``micro=0``), in parameters of different partitions.
RUNS = (
    _run(1, "bf16", Fault(FAULT_STEP, "inf", rank=5, param=2)),
    _run(1, "fp16", Fault(FAULT_STEP, "nan", rank=2, micro=0, param=5)),
    _run(2, "bf16", Fault(FAULT_STEP, "nan", rank=7, micro=0, param=1)),
    _run(2, "fp16", Fault(FAULT_STEP, "inf", rank=0, param=6)),
)


def _digest(params: Dict[str, Any]) -> str:
    sha = hashlib.sha256()
    for name in sorted(params):
        sha.update(name.encode())
        sha.update(params[name].numpy().tobytes())
    return sha.hexdigest()


def summary(result: Dict[str, Any]) -> Dict[str, Any]:
    """The short, JSON form of one rank's result (see the module doc)."""
    keep = ("rank", "node", "local_rank", "host", "world_size", "state", "methods")
    runs = {}
    for name, trace in result["runs"].items():
        runs[name] = {
            "boundary_syncs": [step["boundary_syncs"] for step in trace["steps"]],
            "skipped": [step["skipped"] for step in trace["steps"]],
            "params_sha256": [_digest(step["params"]) for step in trace["steps"]],
            "groups": trace["groups"],
            "seconds": round(trace["seconds"], 1),
        }
    return dict({key: result[key] for key in keep}, runs=runs)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for rank-<RANK>.pkl and .json (on a shared file system)")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher; unused")
    args = parser.parse_args(argv)

    import torch

    from deepspeed_offload_patch.testing.equivalence import trace_runs
    from deepspeed_offload_patch.testing.launch import init_deepspeed_comm

    torch.set_num_threads(1)  # 8 ranks share the machine's cores; one thread each also keeps the bits deterministic
    init_deepspeed_comm()  # from the launcher's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    import deepspeed.comm as dist

    if dist.get_world_size() != WORLD:
        raise SystemExit(f"eight_ranks_train.py needs {WORLD} ranks, not {dist.get_world_size()}")
    result = trace_runs(RUNS)
    result.update({
        "rank": dist.get_rank(),
        "node": int(os.environ.get("CROSS_RANK", "-1")),  # the launcher's node rank (--node_rank of pdsh's %n)
        "local_rank": int(os.environ.get("LOCAL_RANK", "-1")),
        "host": socket.gethostname(),
        "world_size": dist.get_world_size(),
    })
    path = os.path.join(args.out, f"rank-{result['rank']}")
    # Written whole, then renamed: a reader never sees half a file.
    with open(path + ".pkl.tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".pkl.tmp", path + ".pkl")
    with open(path + ".json", "w") as f:
        json.dump(summary(result), f, indent=1)
    dist.barrier()  # no rank tears the process group down while another still trains
    # Torn down before the exit: a rank that exits with its process group alive can abort on a busy machine.
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
