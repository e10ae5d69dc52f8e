# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""A plain ZeRO-2 offload training script, as a training repository has one for a CI smoke run: nothing in it knows
about deepspeed_offload_patch. ``ci/audit.sh`` and ``tests/unit/test_audit.py`` audit it.

    deepspeed --num_gpus 2 ci/smoke_train.py [--deepspeed CONFIG] [--steps 4] [--layers 20] [--nan-step -1]
                                             [--save PREFIX]

``--layers`` Linear layers (two parameter tensors each), synthetic data; a NaN gradient on rank 0 at step
``--nan-step``; ``--save`` writes each rank's parameters and skipped step count to ``PREFIX.<rank>``. The DeepSpeed
config is ``--deepspeed CONFIG`` (a JSON file, as HF Trainer takes it; ``ci/templates/ds_config_smoke.json`` is the
template's) or, without it, the same one built in: ZeRO-2 with the optimizer offloaded to the CPU, bf16 with the
overflow check on, micro-batch 4, gradient accumulation 2.
"""

import argparse
import json

import deepspeed
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--layers", type=int, default=20)
parser.add_argument("--nan-step", type=int, default=-1)
parser.add_argument("--save", default=None)
parser.add_argument("--deepspeed", default=None, metavar="CONFIG", help="a DeepSpeed config JSON file")
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(args.layers)])
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
if args.deepspeed:
    with open(args.deepspeed) as f:
        config = json.load(f)
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
data = torch.Generator().manual_seed(1 + engine.global_rank)
last = model[-1].weight
micro_batch, accumulation = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
dtype = next(engine.module.parameters()).dtype  # bf16 or fp16 when the config enables them, else fp32
for micro in range(accumulation * args.steps):
    x = torch.randn(micro_batch, 16, generator=data).to(engine.device, dtype)
    loss = engine(x).float().pow(2).mean()
    hook = None
    if micro == accumulation * args.nan_step + accumulation - 1 and engine.global_rank == 0:
        hook = last.register_hook(lambda g: torch.full_like(g, float("nan")))
    engine.backward(loss)
    if hook is not None:
        hook.remove()
    engine.step()
print(f"rank {engine.global_rank} done: {engine.global_steps} steps, {engine.skipped_steps} skipped", flush=True)
if args.save:
    state = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    state["skipped"] = torch.tensor(engine.skipped_steps)
    torch.save(state, f"{args.save}.{engine.global_rank}")
# A rank that exits with its process group alive can abort in the teardown on a busy machine.
deepspeed.comm.destroy_process_group()
