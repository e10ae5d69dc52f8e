# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The two-node tests' training job, as small as a real one gets: ZeRO-2, the optimizer offloaded to the CPU, bf16
with the overflow check on, gradient accumulation 2, 4 Linear layers (8 parameter tensors), 2 optimizer steps, data
seeded by the global rank. Nothing in it knows about the package unless ``--import-patch`` is given (the import
route); ``tests/stacks/probe`` measures each rank from outside.

    deepspeed --hostfile HOSTFILE ... train.py [--import-patch]
    torchrun --nnodes 2 ... train.py [--import-patch]
"""

import argparse
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--import-patch", action="store_true", help="import deepspeed_offload_patch first")
parser.add_argument("--steps", type=int, default=2)
args = parser.parse_args()
if args.import_patch:
    import deepspeed_offload_patch  # noqa: F401

import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # 4 ranks share the machine's cores
# DeepSpeed's shared-memory op serves inference's all-reduce only; loading it costs each rank seconds.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "optimizer": {
        "type": "Adam",
        "params": {
            "lr": 1e-3,
            "torch_adam": True
        }
    },
    "bf16": {
        "enabled": True,
        "check_grad_overflow": True
    },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {
            "device": "cpu"
        }
    },
}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
data = torch.Generator().manual_seed(1 + engine.global_rank)
for _ in range(2 * args.steps):
    x = torch.randn(4, 16, generator=data).to(engine.device, torch.bfloat16)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
print(f"rank {engine.global_rank} done: {engine.global_steps} steps", file=sys.stderr, flush=True)
deepspeed.comm.destroy_process_group()  # a rank that exits with its process group alive can abort on a busy machine
