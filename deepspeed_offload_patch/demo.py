# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The patch at work: the same small ZeRO offload run on CPU ranks, unpatched and then patched.

    python -m deepspeed_offload_patch.demo [--num-tensors 120] [--stage 2] [--steps 4] [--nan-step 2] [--dtype bf16]

Each run trains ``--steps`` optimizer steps with gradient accumulation 2 in ``--dtype`` (bf16 with the overflow check
on; fp16 with dynamic loss scaling from ``2**--initial-scale-power``; fp32), and puts a NaN into one parameter's
gradient on rank 0 at step ``--nan-step``. It prints the host syncs counted in
each backward (boundary and not) and in ``step()``, per rank, then compares the two runs: parameters bit for bit
and skipped steps. Exits 1 if the patched boundary backward synchronizes or the runs differ.
"""

import argparse
import os
import sys
from typing import Any, Dict, List

import torch

from deepspeed_offload_patch import settings
from deepspeed_offload_patch.hostsync import READ, count_host_syncs
from deepspeed_offload_patch.states import State
from deepspeed_offload_patch.testing.launch import run_distributed
from deepspeed_offload_patch.testing.models import batch, ds_config, make_engine, optimizer_step, params_snapshot

GRAD_ACCUM = 2


def _rank_job(num_tensors: int, stage: int, steps: int, nan_step: int, dtype: str,
              initial_scale_power: int) -> Dict[str, Any]:
    import warnings

    import deepspeed_offload_patch
    from deepspeed import comm as dist

    warnings.simplefilter("ignore", FutureWarning)  # torch's notes on the collectives DeepSpeed calls

    config = ds_config(stage=stage, dtype=dtype, grad_accum=GRAD_ACCUM, initial_scale_power=initial_scale_power)
    engine = make_engine(num_tensors, config=config)
    poisoned = engine.module.layers[len(engine.module.layers) // 2].weight
    boundary, inner, in_step, skipped = [], [], [], []
    for step in range(steps):
        for micro in range(GRAD_ACCUM):
            handle = None
            if step == nan_step and micro == GRAD_ACCUM - 1 and dist.get_rank() == 0:
                handle = poisoned.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("nan")))
            loss = engine(batch(engine, step * GRAD_ACCUM + micro))
            is_boundary = engine.is_gradient_accumulation_boundary()
            with count_host_syncs(kinds=(READ, )) as syncs:
                engine.backward(loss)
            (boundary if is_boundary else inner).append(syncs.total)
            if handle is not None:
                handle.remove()
            with count_host_syncs(kinds=(READ, )) as syncs:
                optimizer_step(engine)
            if is_boundary:
                in_step.append(syncs.total)
        skipped.append(engine.skipped_steps)
    return {
        "state": deepspeed_offload_patch.status().state,
        "boundary": boundary,
        "inner": inner,
        "step": in_step,
        "skipped": skipped,
        "params": params_snapshot(engine),
    }


def _run(patched: bool, args) -> List[Dict[str, Any]]:
    env = {settings.DISABLE: "0" if patched else "1"}
    return run_distributed(_rank_job,
                           args.world_size,
                           args=(args.num_tensors, args.stage, args.steps, args.nan_step, args.dtype,
                                 args.initial_scale_power),
                           env=env)  # run_distributed's hang guard


def _fmt(values) -> str:
    return " ".join(f"{v:>3}" for v in values)


def build_parser() -> argparse.ArgumentParser:
    """The demo's argument parser (``python -m deepspeed_offload_patch.demo``)."""
    parser = argparse.ArgumentParser(prog="python -m deepspeed_offload_patch.demo",
                                     description=__doc__.splitlines()[0],
                                     epilog="Exit: 0 when the patched run has no host sync in a boundary backward and "
                                     "matches the unpatched one (parameters, skipped steps); else 1.")
    parser.add_argument("--num-tensors", type=int, default=120, help="parameter tensors in the model (even)")
    parser.add_argument("--stage", type=int, choices=(1, 2), default=2, help="ZeRO stage")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--nan-step", type=int, default=2, help="step with a NaN gradient on rank 0 (-1: none)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="training precision")
    parser.add_argument("--initial-scale-power", type=int, default=8, help="fp16: the first loss scale is 2**this")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/torch_extensions"))

    precision = {
        "bf16": "bf16 (check_grad_overflow on)",
        "fp16": f"fp16 (loss scale from 2**{args.initial_scale_power})",
        "fp32": "fp32"
    }[args.dtype]
    print(f"ZeRO-{args.stage}, optimizer offloaded to the CPU, {precision}, "
          f"{args.num_tensors} parameter tensors, {args.world_size} ranks, gradient accumulation {GRAD_ACCUM}, "
          f"{args.steps} steps, NaN on rank 0 at step {args.nan_step}")
    runs = {"unpatched": _run(False, args), "patched": _run(True, args)}

    print("\nhost syncs per optimizer step (one number per step)")
    print(f"{'run':<10} {'rank':>4}  {'state':<10} {'boundary backward':<20} {'other backward':<20} "
          f"{'step()':<20} skipped")
    for name, ranks in runs.items():
        for rank, r in enumerate(ranks):
            print(f"{name:<10} {rank:>4}  {r['state']:<10} {_fmt(r['boundary']):<20} {_fmt(r['inner']):<20} "
                  f"{_fmt(r['step']):<20} {r['skipped'][-1]}")

    failures = []
    for rank, (before, after) in enumerate(zip(runs["unpatched"], runs["patched"])):
        different = [n for n, p in before["params"].items() if not torch.equal(p, after["params"][n])]
        if different:
            failures.append(f"rank {rank}: {len(different)} parameters differ, first {different[0]}")
        if before["skipped"] != after["skipped"]:
            failures.append(f"rank {rank}: skipped steps {before['skipped']} unpatched, {after['skipped']} patched")
        if any(after["boundary"]) or after["state"] != State.APPLIED:
            failures.append(f"rank {rank}: patched run in state {after['state']} synced {after['boundary']}")
    n_params = len(runs["patched"][0]["params"])
    print(f"\nparameters after {args.steps} steps: " +
          ("bit-identical" if not any("differ" in f
                                      for f in failures) else "DIFFERENT") + f" on every rank ({n_params} tensors)")
    for name, ranks in runs.items():
        print(f"skipped steps so far, after each step, {name}: " + "; ".join(f"rank {rank} {r['skipped']}"
                                                                             for rank, r in enumerate(ranks)))
    for failure in failures:
        print(f"FAIL: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
