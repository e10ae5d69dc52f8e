# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Benchmark: host syncs and time per phase against the number of parameter tensors, unpatched vs patched.

Measures the boundary backward, ``step()``, the whole optimizer step and the overflow tracker, unpatched vs patched
vs patched with the on-device grad norm. Needs DeepSpeed 0.17.1 or later (it times
``update_offload_overflow_tracker``, which earlier releases do not have).

    python -m deepspeed_offload_patch.bench --quick          # N = 50, 200 (CI runs it)
    python -m deepspeed_offload_patch.bench                  # N = 50, 200, 800, 3200
    python -m deepspeed_offload_patch.bench --world-size 1   # on a GPU machine: also counts CUDA syncs

Each variant runs in its own set of spawned ranks (the patch is chosen per process). For every ZeRO stage
(1, 2), precision (bf16 with the overflow check on, bf16 with it off, fp32) and model size N (``N / 2`` small
Linear layers), with the optimizer offloaded to the CPU and gradient accumulation 2:

* host syncs: the reads of tensor values that ``count_host_syncs`` counts, in the boundary backward, in ``step()``
  and in the whole optimizer step (every micro-step's forward and backward, then ``step()``), counted in the first
  step; beside them every kind of host wait it counts (reads, event and stream waits, device syncs, blocking copies:
  ``{phase}_waits``; on the CPU, DeepSpeed's own wait points), and a fourth variant, every change on (the opt-in ones
  too), whose whole step must make as many of each kind at one N as at another (blocking copies aside: they are
  ``pin_memory``'s, which ``affected`` names);
* wall time of the same three: median over the measured steps after warm-up, the slowest rank's;
* time spent in ``update_offload_overflow_tracker`` itself per boundary backward, and the number of PyTorch ops it
  runs (with the check off, the patched tracker runs none);
* on CUDA, ``cudaStreamSynchronize``, ``aten::item`` and the other host waits counted by ``torch.profiler`` in the
  boundary backward, ``step()`` and the whole step (one more step, not timed).

Prints a table with unpatched/patched ratios, writes JSON and a PNG plot per stage (matplotlib); with ``--readme
PATH``, writes the table into PATH and its JSON beside it (``docs/benchmark.json``), from which the docs test renders
the table again. Exits 1 if a patched boundary backward synchronizes with the host, if the whole step with the
on-device grad norm makes a different number of host syncs at one N than at another, if with every change on it
makes a different number of host waits of some kind (blocking copies aside), if a patched run was not patched, or if a run crashes (with its traceback); 2 on a DeepSpeed before 0.17.1.
"""

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from deepspeed_offload_patch import settings
from deepspeed_offload_patch.changes import CHANGES, by_name
# The rendering of the results; render_table and render_cuda_table re-exported here (bench.render_table).
from deepspeed_offload_patch.bench_report import (ALL_CHANGES, GRAD_ACCUM, GRAD_NORM, _growing_whole_steps,
                                                  _write_readme, plot)
from deepspeed_offload_patch.bench_report import render_cuda_table, render_readme, render_table  # noqa: F401
from deepspeed_offload_patch.hostsync import KINDS, count_host_syncs
from deepspeed_offload_patch.states import State
from deepspeed_offload_patch.testing.launch import run_distributed
from deepspeed_offload_patch.testing.models import batch, ds_config, make_engine, optimizer_step

MODES = {
    "bf16-check": {
        "dtype": "bf16",
        "check_grad_overflow": True
    },
    "bf16-nocheck": {
        "dtype": "bf16",
        "check_grad_overflow": False
    },
    "fp32": {
        "dtype": "fp32",
        "check_grad_overflow": False
    },
}
VARIANTS = {
    "unpatched": {
        settings.DISABLE: "1",
        GRAD_NORM: "0"
    },
    "patched": {
        settings.DISABLE: "0",
        GRAD_NORM: "0"
    },
    "patched+grad-norm": {
        settings.DISABLE: "0",
        GRAD_NORM: "1"
    },
    # The defaults and every opt-in change: what the package can do today.
    ALL_CHANGES: {
        settings.DISABLE: "0",
        settings.UPSTREAM_ONLY: "0",
        GRAD_NORM: "1",
        **{
            change.switch: "1"
            for change in CHANGES if change.opt_in
        }
    },
}
# What the host waits on, as torch.profiler names it on CUDA.
CUDA_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::item")


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the PyTorch ops (kernel launches on a device) run inside it."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _TrackerProbe:
    """Wraps one optimizer's ``update_offload_overflow_tracker`` (on the instance) to time it and count its ops."""

    def __init__(self, optimizer):
        self.method = type(optimizer).update_offload_overflow_tracker.__get__(optimizer)
        self.seconds = 0.0
        self.ops = 0
        self.count_ops = False
        optimizer.update_offload_overflow_tracker = self

    def __call__(self, grad):
        if self.count_ops:
            with _OpCounter() as counter:
                self.method(grad)
            self.ops += counter.ops
            return
        start = time.perf_counter()
        self.method(grad)
        self.seconds += time.perf_counter() - start


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


PHASES = ("before", "backward", "step")  # one optimizer step: the micro-steps before the boundary with its forward,
# the boundary backward, step()


def _phases(engine, step: int, grad_accum: int = GRAD_ACCUM) -> Dict[str, Callable[[], None]]:
    """One optimizer step of ``grad_accum`` micro-steps, as three callables to run in order (see ``PHASES``)."""
    held = {}

    def before() -> None:
        for micro in range(grad_accum - 1):
            engine.backward(engine(batch(engine, step * grad_accum + micro)))
            optimizer_step(engine)  # DeepSpeed counts micro-steps in step(); it updates only at the boundary
        held["loss"] = engine(batch(engine, step * grad_accum + grad_accum - 1))

    return {
        "before": before,
        "backward": lambda: engine.backward(held.pop("loss")),
        "step": lambda: optimizer_step(engine)
    }


def _cuda_sync_events(run: Callable[[], None]) -> Dict[str, int]:
    """``cudaStreamSynchronize`` (and the other waits of the host for the device) and ``aten::item`` that
    ``torch.profiler`` records while ``run()`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
    counts = dict.fromkeys(CUDA_EVENTS, 0)
    for event in prof.key_averages():
        if event.key in counts:
            counts[event.key] += event.count
    torch.cuda.synchronize()
    return counts


def _measure(stage: int,
             mode: str,
             num_tensors: int,
             warmup: int,
             steps: int,
             grad_accum: int = GRAD_ACCUM) -> Dict[str, Any]:
    engine = make_engine(num_tensors, config=ds_config(stage=stage, grad_accum=grad_accum, **MODES[mode]))
    probe = _TrackerProbe(engine.optimizer)
    times: Dict[str, List[float]] = {f"{phase}_s": [] for phase in PHASES + ("whole", "tracker")}
    result: Dict[str, Any] = {}
    profiled = 1 if engine.device.type == "cuda" else 0  # on CUDA one more step, profiled, after the counting one
    for step in range(1 + profiled + warmup + steps):
        phases = _phases(engine, step, grad_accum)
        if step == 0:  # the counting step: counters slow things down, so nothing is timed here
            for phase, run in phases.items():
                probe.count_ops = phase == "backward"
                with count_host_syncs() as syncs:
                    run()
                result[f"{phase}_syncs"] = syncs.reads
                result[f"{phase}_waits"] = syncs.by_kind
            probe.count_ops = False
            result["tracker_ops"] = probe.ops
            result["whole_syncs"] = sum(result[f"{phase}_syncs"] for phase in PHASES)
            result["whole_waits"] = {kind: sum(result[f"{phase}_waits"][kind] for phase in PHASES) for kind in KINDS}
            continue
        if profiled and step == 1:  # the profiled step, not timed either
            cuda = {phase: _cuda_sync_events(run) for phase, run in phases.items()}
            cuda["whole"] = {key: sum(cuda[phase][key] for phase in PHASES) for key in CUDA_EVENTS}
            result["cuda"] = cuda
            continue
        probe.seconds = 0.0
        spent = {}
        for phase, run in phases.items():
            _sync(engine)
            start = time.perf_counter()
            run()
            _sync(engine)
            spent[phase] = time.perf_counter() - start
        if step > profiled + warmup:
            for phase in PHASES:
                times[f"{phase}_s"].append(spent[phase])
            times["whole_s"].append(sum(spent.values()))
            times["tracker_s"].append(probe.seconds)
    result.update({key: statistics.median(values) for key, values in times.items()})
    result["device"] = str(engine.device)
    del engine
    return result


def _rank_job(configs: List[tuple], warmup: int, steps: int, grad_accum: int = GRAD_ACCUM) -> List[Dict[str, Any]]:
    import warnings

    import deepspeed_offload_patch

    warnings.simplefilter("ignore", FutureWarning)
    state = deepspeed_offload_patch.status()
    rows = []
    for stage, mode, num_tensors in configs:
        row = _measure(stage, mode, num_tensors, warmup, steps, grad_accum)
        row.update(stage=stage,
                   mode=mode,
                   n=num_tensors,
                   state=state.state,
                   grad_norm=state.of(by_name("grad-norm"))[0])
        rows.append(row)
    return rows


def _combine(per_rank: List[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """One row per configuration: counts from rank 0 plus the largest on any rank, times of the slowest rank."""
    rows = []
    for ranks in zip(*per_rank):
        row = dict(ranks[0])
        for key in [f"{phase}_syncs" for phase in PHASES + ("whole", )] + ["tracker_ops"]:
            row[f"{key}_max"] = max(r[key] for r in ranks)
        for key in [f"{phase}_s" for phase in PHASES + ("whole", "tracker")]:
            row[key] = max(r[key] for r in ranks)
        for key in [f"{phase}_waits" for phase in PHASES + ("whole", )]:
            row[f"{key}_max"] = {kind: max(r[key][kind] for r in ranks) for kind in KINDS}
        rows.append(row)
    return rows


def _deepspeed_version() -> str:
    from deepspeed_offload_patch.patcher import deepspeed_version
    return deepspeed_version() or "?"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's argument parser (``python -m deepspeed_offload_patch.bench``)."""
    parser = argparse.ArgumentParser(
        prog="python -m deepspeed_offload_patch.bench",
        description=__doc__.splitlines()[0],
        epilog="Needs DeepSpeed 0.17.1 or later. Exit: 0; 1 if a patched boundary "
        "backward synchronizes with the host, the whole step with the on-device grad norm "
        "makes a different number of host syncs at one N than at another, the whole step with every change on "
        "makes a different number of host waits of some kind (blocking copies aside), a patched run "
        "was not patched, or a run crashed; 2 on a DeepSpeed before 0.17.1.")
    parser.add_argument("--quick", action="store_true", help="N = 50, 200, fewer steps (CI)")
    parser.add_argument("--sizes", type=int, nargs="+", help="parameter tensors (default 50 200 800 3200)")
    parser.add_argument("--stages",
                        type=int,
                        nargs="+",
                        default=[1, 2],
                        choices=(1, 2),
                        help="ZeRO stages (default both)")
    parser.add_argument("--modes",
                        nargs="+",
                        default=list(MODES),
                        choices=list(MODES),
                        help="precisions: bf16 with the overflow check on, off, fp32 (default all)")
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=GRAD_ACCUM,
        help=f"micro-steps per optimizer step (default {GRAD_ACCUM}; 4 shows the gradient-accumulation "
        "fix adds no host sync)")
    parser.add_argument("--warmup", type=int, help="untimed steps after the counting step (default 2, quick 1)")
    parser.add_argument("--steps", type=int, help="timed steps (default 5, quick 3)")
    parser.add_argument("--world-size",
                        type=int,
                        default=2,
                        help="ranks (default 2); on a GPU each rank needs a device of its own: more ranks than "
                        "devices exit 2 before anything runs")
    parser.add_argument("--out",
                        default=os.path.join("reports", "bench"),
                        help="folder for bench.json and bench-zero<stage>.png")
    parser.add_argument(
        "--readme",
        metavar="PATH",
        help="also write the table into this Markdown file (docs/benchmark.md), between the "
        "<!-- bench:start --> and <!-- bench:end --> markers, and its JSON beside it (docs/benchmark.json)")
    return parser


def _too_few_devices(world_size: int) -> Optional[int]:
    """The device count of DeepSpeed's accelerator when it is a real device and has fewer than ``world_size``; None
    otherwise (the CPU accelerator runs any number of ranks)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return None
    count = accelerator.device_count()
    return count if count < world_size else None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from packaging.version import Version

    if Version(_deepspeed_version()) < Version("0.17.1"):
        print(
            f"bench: needs DeepSpeed 0.17.1 or later (it times update_offload_overflow_tracker); this is "
            f"{_deepspeed_version()}",
            file=sys.stderr)
        return 2
    devices = _too_few_devices(args.world_size)
    if devices is not None:
        print(
            f"bench: --world-size {args.world_size} needs a device per rank; this machine's accelerator has "
            f"{devices}: pass --world-size {max(devices, 1)}",
            file=sys.stderr)
        return 2
    sizes = args.sizes or ([50, 200] if args.quick else [50, 200, 800, 3200])
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    steps = args.steps or (3 if args.quick else 5)
    configs = [(stage, mode, n) for stage in args.stages for mode in args.modes for n in sizes]

    started = time.time()
    results = {}
    for variant, env in VARIANTS.items():
        print(f"running {variant}: {len(configs)} configurations on {args.world_size} ranks", flush=True)
        per_rank = run_distributed(_rank_job,
                                   args.world_size,
                                   args=(configs, warmup, steps, args.grad_accum),
                                   env=env,
                                   timeout=3600)
        results[variant] = _combine(per_rank)

    data = {
        "world_size": args.world_size,
        "warmup": warmup,
        "steps": steps,
        "grad_accum": args.grad_accum,
        "torch": torch.__version__,
        "deepspeed": _deepspeed_version(),
        "results": results
    }
    print()
    print(render_readme(data))
    if args.readme:
        _write_readme(args.readme, render_readme(data))
        with open(os.path.splitext(args.readme)[0] + ".json", "w") as f:
            json.dump(data, f, indent=1)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(data, f, indent=1)
    drawn = [plot(results, os.path.join(args.out, f"bench-zero{stage}.png"), stage) for stage in args.stages]
    print(f"wrote {os.path.join(args.out, 'bench.json')}" +
          (f" and bench-zero{{{','.join(map(str, args.stages))}}}.png"
           if all(drawn) else " (no plot: pip install matplotlib)") + f" in {time.time() - started:.0f} s")

    bad = [r for v in ("patched", "patched+grad-norm") for r in results[v] if r["backward_syncs_max"] > 0]
    for r in bad:
        print(f"FAIL: patched boundary backward synchronized: stage {r['stage']} {r['mode']} N={r['n']}: "
              f"{r['backward_syncs_max']} host syncs")
    growing = _growing_whole_steps(results["patched+grad-norm"])
    for line in growing:
        print(f"FAIL: patched with the on-device grad norm, the whole step's host syncs grow with N: {line}")
    waiting = _growing_whole_steps(results[ALL_CHANGES], kinds=True)
    for line in waiting:
        print(f"FAIL: with every change on, the whole step's host waits grow with N: {line}")
    not_patched = [v for v in ("patched", "patched+grad-norm", ALL_CHANGES) if results[v][0]["state"] != State.APPLIED]
    for variant in not_patched:
        print(f"FAIL: the {variant} run was not patched ({results[variant][0]['state']})")
    return 1 if bad or growing or waiting or not_patched else 0


if __name__ == "__main__":
    sys.exit(main())
