# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Reproducer: with ZeRO-1/2, offload_optimizer and fp32 gradient accumulation, one inf makes DeepSpeed 0.19.8 skip
every later step.

Self-contained: torch and deepspeed only, the CPU, 2 ranks on gloo, under a minute. It trains a small model for 6
optimizer steps (gradient accumulation 2) with an inf in one gradient on rank 0 at step 1, and prints the skipped
steps after each step: as DeepSpeed does it, then with the one-method change of ``skipped-step.diff`` applied
in-process (``reset_cpu_buffers`` also drops the compact fp32 gradient buffers after a skipped step).

    python repro_skipped_step.py [--stage 1|2] [--precision bf16|fp16]
"""

import argparse
import logging
import os
import socket
import warnings

import torch
import torch.multiprocessing as mp

STEPS, ACCUM, FAULT_STEP = 6, 2, 1


def fixed_reset_cpu_buffers(self):
    self._wait_for_offload_copies()
    self.norm_for_param_grads = {}
    self.local_overflow = False
    if getattr(self, "overflow", False):
        for group_idx in list(self.averaged_gradients):
            if self._use_compact_grad_partition_buffer(group_idx):
                self.averaged_gradients[group_idx] = None


def rank_main(rank, port, stage, precision, fixed, queue):
    os.environ.update(RANK=str(rank),
                      LOCAL_RANK=str(rank),
                      WORLD_SIZE="2",
                      LOCAL_SIZE="2",
                      MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)  # torch's notes on the collectives DeepSpeed calls
    import deepspeed
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip the JIT build of the CPU shm op
    if precision == "fp16":
        get_accelerator().is_fp16_supported = lambda: True  # torch runs fp16 on the CPU; DeepSpeed's CPU check says no
    if fixed:
        DeepSpeedZeroOptimizer.reset_cpu_buffers = fixed_reset_cpu_buffers
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ACCUM,
        precision: {
            "enabled": True,
            **({
                "initial_scale_power": 8
            } if precision == "fp16" else {})
        },
        "data_types": {
            "grad_accum_dtype": "fp32"
        },
        "zero_optimization": {
            "stage": stage,
            "offload_optimizer": {
                "device": "cpu"
            }
        },
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-3,
                "torch_adam": True
            }
        },
        "zero_force_ds_cpu_optimizer": False,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    skipped = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            torch.manual_seed(1000 * step + 10 * micro + rank)
            x = torch.randn(2, 16, dtype=engine.module[0].weight.dtype)
            hook = None
            if step == FAULT_STEP and micro == ACCUM - 1 and rank == 0:
                hook = engine.module[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
            engine.backward(engine(x).float().pow(2).mean())
            if hook is not None:
                hook.remove()
            engine.step()
        skipped.append(engine.skipped_steps)
    queue.put((rank, skipped))


def run(stage, precision, fixed):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=rank_main, args=(r, port, stage, precision, fixed, queue)) for r in range(2)]
    for p in processes:
        p.start()
    results = dict(queue.get() for _ in processes)
    for p in processes:
        p.join()
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=(1, 2), default=2)
    parser.add_argument("--precision", choices=("bf16", "fp16"), default="bf16")
    args = parser.parse_args()
    import deepspeed
    print(f"DeepSpeed {deepspeed.__version__}, ZeRO-{args.stage}, offload_optimizer cpu, {args.precision}, "
          f"grad_accum_dtype fp32, accumulation {ACCUM}, inf on rank 0 at step {FAULT_STEP} of {STEPS}")
    for name, fixed in (("as released", False), ("with the change", True)):
        results = run(args.stage, args.precision, fixed)
        for rank, skipped in sorted(results.items()):
            print(f"{name:16} rank {rank}: skipped steps after each step {skipped}")


if __name__ == "__main__":
    main()
