# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Benchmark: host syncs and time of the boundary backward, of ``step()`` and of the overflow tracker, against the
number of parameter tensors, unpatched vs patched vs patched with the opt-in on-device grad norm.

    python -m deepspeed_offload_patch.bench --quick          # N = 50, 200; about 2 minutes on 2 CPU cores
    python -m deepspeed_offload_patch.bench                  # N = 50, 200, 800, 3200
    python -m deepspeed_offload_patch.bench --world-size 1   # on a GPU machine: also counts CUDA syncs

Each variant runs in its own set of spawned ranks (the patch is chosen per process). For every ZeRO stage
(1, 2), precision (bf16 with the overflow check on, bf16 with it off, fp32) and model size N (``N / 2`` small
Linear layers), with the optimizer offloaded to the CPU and gradient accumulation 2:

* host syncs (``count_host_syncs``) in the boundary backward and in ``step()``, counted in the first step;
* wall time of the boundary backward and of ``step()``: median over the measured steps after warm-up, the slowest
  rank's;
* time spent in ``update_offload_overflow_tracker`` itself per boundary backward, and the number of PyTorch ops it
  runs (with the check off, the patched tracker runs none);
* on CUDA, ``cudaStreamSynchronize`` and ``aten::item`` counted by ``torch.profiler`` in the boundary backward.

Prints a table with unpatched/patched ratios, writes JSON and a PNG plot (matplotlib). Exits 1 if a patched
boundary backward synchronizes with the host.
"""

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import torch

from deepspeed_offload_patch.hostsync import count_host_syncs
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
        "DS_OFFLOAD_PATCH_DISABLE": "1",
        "DS_OFFLOAD_PATCH_GRAD_NORM": "0"
    },
    "patched": {
        "DS_OFFLOAD_PATCH_DISABLE": "0",
        "DS_OFFLOAD_PATCH_GRAD_NORM": "0"
    },
    "patched+grad-norm": {
        "DS_OFFLOAD_PATCH_DISABLE": "0",
        "DS_OFFLOAD_PATCH_GRAD_NORM": "1"
    },
}
GRAD_ACCUM = 2


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


def _cuda_sync_events(engine, loss) -> Dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.backward(loss)
    counts = {"cudaStreamSynchronize": 0, "aten::item": 0}
    for event in prof.key_averages():
        if event.key in counts:
            counts[event.key] += event.count
    return counts


def _measure(stage: int, mode: str, num_tensors: int, warmup: int, steps: int) -> Dict[str, Any]:
    engine = make_engine(num_tensors, config=ds_config(stage=stage, grad_accum=GRAD_ACCUM, **MODES[mode]))
    probe = _TrackerProbe(engine.optimizer)
    result: Dict[str, Any] = {"backward_s": [], "step_s": [], "tracker_s": []}
    for step in range(1 + warmup + steps):
        engine.backward(engine(batch(engine, step * GRAD_ACCUM)))
        optimizer_step(engine)
        loss = engine(batch(engine, step * GRAD_ACCUM + 1))
        if step == 0:  # the counting step: counters slow things down, so nothing is timed here
            probe.count_ops = True
            with count_host_syncs() as syncs:
                engine.backward(loss)
            probe.count_ops = False
            result["backward_syncs"], result["tracker_ops"] = syncs.total, probe.ops
            with count_host_syncs() as syncs:
                optimizer_step(engine)
            result["step_syncs"] = syncs.total
            continue
        if engine.device.type == "cuda" and step == 1:
            result["cuda"] = _cuda_sync_events(engine, loss)
            optimizer_step(engine)
            continue
        probe.seconds = 0.0
        _sync(engine)
        start = time.perf_counter()
        engine.backward(loss)
        _sync(engine)
        middle = time.perf_counter()
        optimizer_step(engine)
        _sync(engine)
        end = time.perf_counter()
        if step > warmup:
            result["backward_s"].append(middle - start)
            result["step_s"].append(end - middle)
            result["tracker_s"].append(probe.seconds)
    for key in ("backward_s", "step_s", "tracker_s"):
        result[key] = statistics.median(result[key])
    result["device"] = str(engine.device)
    del engine
    return result


def _rank_job(configs: List[tuple], warmup: int, steps: int) -> List[Dict[str, Any]]:
    import warnings

    import deepspeed_offload_patch

    warnings.simplefilter("ignore", FutureWarning)
    state = deepspeed_offload_patch.status()
    rows = []
    for stage, mode, num_tensors in configs:
        row = _measure(stage, mode, num_tensors, warmup, steps)
        row.update(stage=stage, mode=mode, n=num_tensors, state=state.state, grad_norm=state.grad_norm_on_device)
        rows.append(row)
    return rows


def _combine(per_rank: List[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """One row per configuration: counts from rank 0 plus the largest on any rank, times of the slowest rank."""
    rows = []
    for ranks in zip(*per_rank):
        row = dict(ranks[0])
        for key in ("backward_syncs", "step_syncs", "tracker_ops"):
            row[f"{key}_max"] = max(r[key] for r in ranks)
        for key in ("backward_s", "step_s", "tracker_s"):
            row[key] = max(r[key] for r in ranks)
        rows.append(row)
    return rows


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b > 0 else ("-" if a == 0 else "inf")


def render_table(results: Dict[str, List[Dict[str, Any]]]) -> str:
    un, pa, gn = results["unpatched"], results["patched"], results["patched+grad-norm"]
    header = (
        "| stage | mode | N | backward syncs (unpatched / patched) | step syncs (unpatched / patched / +grad norm) "
        "| backward ms (unpatched / patched, ratio) | step ms (unpatched / patched / +grad norm) "
        "| tracker ms (unpatched / patched) | tracker ops (unpatched / patched) |")
    lines = [header, "|" + " --- |" * 9]
    for u, p, g in zip(un, pa, gn):
        lines.append(f"| {u['stage']} | {u['mode']} | {u['n']} | {u['backward_syncs']} / {p['backward_syncs']} "
                     f"| {u['step_syncs']} / {p['step_syncs']} / {g['step_syncs']} "
                     f"| {u['backward_s'] * 1e3:.1f} / {p['backward_s'] * 1e3:.1f}, "
                     f"{_ratio(u['backward_s'], p['backward_s'])} "
                     f"| {u['step_s'] * 1e3:.1f} / {p['step_s'] * 1e3:.1f} / {g['step_s'] * 1e3:.1f} "
                     f"| {u['tracker_s'] * 1e3:.2f} / {p['tracker_s'] * 1e3:.2f} "
                     f"| {u['tracker_ops']} / {p['tracker_ops']} |")
    if "cuda" in un[0]:
        lines.append("\nCUDA, boundary backward: cudaStreamSynchronize / aten::item, unpatched vs patched")
        for u, p in zip(un, pa):
            lines.append(
                f"stage {u['stage']} {u['mode']} N={u['n']}: {u['cuda']['cudaStreamSynchronize']} / "
                f"{u['cuda']['aten::item']} vs {p['cuda']['cudaStreamSynchronize']} / {p['cuda']['aten::item']}")
    return "\n".join(lines) + "\n"


def plot(results: Dict[str, List[Dict[str, Any]]], path: str, stage: int) -> bool:
    """Syncs and times against N for one stage, log-log. False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    panels = (("backward_syncs", "host syncs, boundary backward"), ("step_syncs", "host syncs, step()"),
              ("backward_s", "boundary backward (s)"), ("tracker_s", "overflow tracker per boundary backward (s)"))
    for ax, (key, title) in zip(axes, panels):
        for variant, rows in results.items():
            for mode in MODES:
                points = [(r["n"], r[key]) for r in rows if r["stage"] == stage and r["mode"] == mode]
                if not points:
                    continue
                xs, ys = zip(*points)
                style = {"unpatched": "-", "patched": "--", "patched+grad-norm": ":"}[variant]
                ax.plot(xs, [max(y, 0.5 if "syncs" in key else y) for y in ys],
                        style,
                        marker="o",
                        label=f"{variant}, {mode}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameter tensors (N)")
        ax.set_title(title)
    axes[0].set_ylabel("count per rank (0 is drawn at 0.5)")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"ZeRO-{stage}, optimizer offloaded to the CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _deepspeed_version() -> str:
    from deepspeed_offload_patch.patcher import deepspeed_version
    return deepspeed_version() or "?"


def _write_readme(path: str, text: str) -> None:
    start, end = "<!-- bench:start -->", "<!-- bench:end -->"
    with open(path) as f:
        content = f.read()
    head, rest = content.split(start, 1)
    with open(path, "w") as f:
        f.write(f"{head}{start}\n{text}{end}{rest.split(end, 1)[1]}")


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's argument parser (``python -m deepspeed_offload_patch.bench``)."""
    parser = argparse.ArgumentParser(prog="python -m deepspeed_offload_patch.bench",
                                     description=__doc__.splitlines()[0],
                                     epilog="Exit: 0, or 1 if a patched boundary backward synchronizes with the host.")
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
    parser.add_argument("--warmup", type=int, help="untimed steps after the counting step (default 2, quick 1)")
    parser.add_argument("--steps", type=int, help="timed steps (default 5, quick 3)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2; 1 on a one-GPU machine)")
    parser.add_argument("--out", default=os.path.join("reports", "bench"), help="folder for bench.json, bench.png")
    parser.add_argument("--readme",
                        metavar="PATH",
                        help="also write the table into this Markdown file (docs/benchmark.md), between the "
                        "<!-- bench:start --> and <!-- bench:end --> markers")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    sizes = args.sizes or ([50, 200] if args.quick else [50, 200, 800, 3200])
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    steps = args.steps or (3 if args.quick else 5)
    configs = [(stage, mode, n) for stage in args.stages for mode in args.modes for n in sizes]

    started = time.time()
    results = {}
    for variant, env in VARIANTS.items():
        print(f"running {variant}: {len(configs)} configurations on {args.world_size} ranks", flush=True)
        per_rank = run_distributed(_rank_job, args.world_size, args=(configs, warmup, steps), env=env, timeout=3600)
        results[variant] = _combine(per_rank)

    table = render_table(results)
    caption = (f"device: {results['patched'][0]['device']}, {args.world_size} ranks, torch {torch.__version__}, "
               f"DeepSpeed {_deepspeed_version()}, gradient accumulation {GRAD_ACCUM}; syncs per rank; times in ms, "
               f"median of {steps} steps after {warmup} warm-up, the slowest rank's")
    print()
    print(caption)
    print(table)
    if args.readme:
        _write_readme(args.readme, f"{caption}\n\n{table}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"world_size": args.world_size, "warmup": warmup, "steps": steps, "results": results}, f, indent=1)
    drawn = [plot(results, os.path.join(args.out, f"bench-zero{stage}.png"), stage) for stage in args.stages]
    print(f"wrote {os.path.join(args.out, 'bench.json')}" +
          (f" and bench-zero{{{','.join(map(str, args.stages))}}}.png"
           if all(drawn) else " (no plot: pip install matplotlib)") + f" in {time.time() - started:.0f} s")

    bad = [r for v in ("patched", "patched+grad-norm") for r in results[v] if r["backward_syncs_max"] > 0]
    for r in bad:
        print(f"FAIL: patched boundary backward synchronized: stage {r['stage']} {r['mode']} N={r['n']}: "
              f"{r['backward_syncs_max']} host syncs")
    not_patched = [v for v in ("patched", "patched+grad-norm") if results[v][0]["state"] != "applied"]
    for variant in not_patched:
        print(f"FAIL: the {variant} run was not patched ({results[variant][0]['state']})")
    return 1 if bad or not_patched else 0


if __name__ == "__main__":
    sys.exit(main())
