# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The benchmark's results as README's table, the CUDA table and the plots (:mod:`deepspeed_offload_patch.bench`
measures them)."""

from typing import Any, Dict, List

from deepspeed_offload_patch.changes import by_name
from deepspeed_offload_patch.waits import BLOCKING_COPY, KINDS

#: Micro-steps per optimizer step in every measured run.
GRAD_ACCUM = 2
# The on-device grad norm's own switch: the benchmark measures it apart from the boundary backward's fix.
GRAD_NORM = by_name("grad-norm").switch
#: The variant with every change on, the opt-in ones too.
ALL_CHANGES = "all-changes"
KIND_COLUMNS = dict(zip(KINDS, ("reads", "event waits", "stream waits", "device syncs", "blocking copies")))
PHASE_NAMES = {"backward": "boundary backward", "step": "step()", "whole": "whole step"}


def render_cuda_table(results: Dict[str, List[Dict[str, Any]]]) -> str:
    """The Markdown table of host waits on CUDA per phase (boundary backward, step(), whole step): the counter's
    count and the profiler's, each as unpatched / patched / +grad norm."""
    variants = ("unpatched", "patched", "patched+grad-norm")
    keys = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "aten::item")
    lines = ["| stage | mode | N | phase | counted | " + " | ".join(keys) + " |", "|" + " --- |" * (5 + len(keys))]
    for rows in zip(*(results[v] for v in variants)):
        first = rows[0]
        for phase in ("backward", "step", "whole"):
            cells = [" / ".join(str(r[f"{phase}_syncs_max"]) for r in rows)]
            cells += [" / ".join(str(r["cuda"][phase][key]) for r in rows) for key in keys]
            lines.append(f"| {first['stage']} | {first['mode']} | {first['n']} | {PHASE_NAMES[phase]} | " +
                         " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _growing_whole_steps(rows: List[Dict[str, Any]], kinds: bool = False) -> List[str]:
    """For each stage and mode measured at more than one N: its whole-step counts of host syncs (with ``kinds``: of
    host waits by kind, blocking copies aside), where they are not all equal."""
    by_config: Dict[tuple, Dict[int, Any]] = {}
    for r in rows:
        # Blocking copies are pin_memory's (pageable by default before 0.19.5): affected names that setting.
        waits = {kind: count for kind, count in r["whole_waits_max"].items() if kind != BLOCKING_COPY} if kinds else {}
        count = _kinds_text(waits) if kinds else r["whole_syncs_max"]
        by_config.setdefault((r["stage"], r["mode"]), {})[r["n"]] = count
    return [
        f"ZeRO-{stage} {mode}: " + ", ".join(f"N={n} {count}" for n, count in sorted(counts.items()))
        for (stage, mode), counts in by_config.items() if len(set(counts.values())) > 1
    ]


def _kinds_text(waits: Dict[str, int]) -> str:
    """``read 3, event wait 1`` (the kinds seen; ``none`` when none was)."""
    return ", ".join(f"{kind} {count}" for kind, count in waits.items() if count) or "none"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b > 0 else ("-" if a == 0 else "inf")


def render_table(results: Dict[str, List[Dict[str, Any]]]) -> str:
    """The Markdown table of counts and times (and, on CUDA, a second one of the profiler's counts per phase)."""
    un, pa, gn = results["unpatched"], results["patched"], results["patched+grad-norm"]
    header = ("| stage | mode | N | backward syncs (unpatched / patched) "
              "| step syncs (unpatched / patched / +grad norm) | whole-step syncs (unpatched / patched / +grad norm) "
              "| backward ms (unpatched / patched, ratio) | step ms (unpatched / patched / +grad norm) "
              "| whole step ms (unpatched / patched / +grad norm) "
              "| tracker ms (unpatched / patched) | tracker ops (unpatched / patched) |")
    lines = [header, "|" + " --- |" * 11]

    def three(key: str, scale: float = 0, places: int = 1) -> str:
        values = [r[key] * scale if scale else r[key] for r in (u, p, g)]
        return " / ".join(f"{v:.{places}f}" if scale else str(v) for v in values)

    for u, p, g in zip(un, pa, gn):
        lines.append(f"| {u['stage']} | {u['mode']} | {u['n']} | {u['backward_syncs']} / {p['backward_syncs']} "
                     f"| {three('step_syncs')} | {three('whole_syncs')} "
                     f"| {u['backward_s'] * 1e3:.1f} / {p['backward_s'] * 1e3:.1f}, "
                     f"{_ratio(u['backward_s'], p['backward_s'])} "
                     f"| {three('step_s', 1e3)} | {three('whole_s', 1e3)} "
                     f"| {u['tracker_s'] * 1e3:.2f} / {p['tracker_s'] * 1e3:.2f} "
                     f"| {u['tracker_ops']} / {p['tracker_ops']} |")
    if "whole_waits_max" in un[0] and ALL_CHANGES in results:
        lines += ["", render_waits_table(results).rstrip("\n")]
    if "cuda" in un[0]:
        lines += [
            "", "CUDA, one step per rank; unpatched / patched / +grad norm; counted: the host-sync counter, the rest "
            "recorded by torch.profiler", "",
            render_cuda_table(results).rstrip("\n")
        ]
    return "\n".join(lines) + "\n"


def render_waits_table(results: Dict[str, List[Dict[str, Any]]]) -> str:
    """The host waits of the whole optimizer step by kind (reads, event and stream waits, device syncs, blocking
    copies; on the CPU accelerator, DeepSpeed's own wait points), the slowest rank's: unpatched / the package's
    defaults / every change on."""
    variants = ("unpatched", "patched+grad-norm", ALL_CHANGES)
    lines = [
        "Host waits of the whole optimizer step, by kind: unpatched / defaults / every change on (opt-in ones too)",
        "", "| stage | mode | N | " + " | ".join(KIND_COLUMNS[kind] for kind in KINDS) + " |",
        "|" + " --- |" * (3 + len(KINDS))
    ]
    for rows in zip(*(results[v] for v in variants)):
        first = rows[0]
        cells = [" / ".join(str(r["whole_waits_max"][kind]) for r in rows) for kind in KINDS]
        lines.append(f"| {first['stage']} | {first['mode']} | {first['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: Dict[str, List[Dict[str, Any]]], path: str, stage: int) -> bool:
    """Syncs and times against N for one stage, log-log. False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 5, figsize=(25, 4.8))
    panels = (("backward_syncs", "host syncs, boundary backward"), ("step_syncs", "host syncs, step()"),
              ("whole_syncs", "host syncs, whole optimizer step"), ("whole_s", "whole optimizer step (s)"),
              ("tracker_s", "overflow tracker per boundary backward (s)"))
    for ax, (key, title) in zip(axes, panels):
        for variant, rows in results.items():
            for mode in dict.fromkeys(r["mode"] for r in rows):
                points = [(r["n"], r[key]) for r in rows if r["stage"] == stage and r["mode"] == mode]
                if not points:
                    continue
                xs, ys = zip(*points)
                style = {"unpatched": "-", "patched": "--", "patched+grad-norm": ":", ALL_CHANGES: "-."}[variant]
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


def render_readme(data: Dict[str, Any]) -> str:
    """The caption and table that ``--readme`` writes, from the benchmark's JSON (``docs/benchmark.json``)."""
    results = data["results"]
    caption = (
        f"device: {results['patched'][0]['device']}, {data['world_size']} ranks, torch {data['torch']}, "
        f"DeepSpeed {data['deepspeed']}, gradient accumulation {data.get('grad_accum', GRAD_ACCUM)}; syncs per rank; times in ms, "
        f"median of {data['steps']} steps after {data['warmup']} warm-up, the slowest rank's. patched: "
        f"{GRAD_NORM}=0 (the boundary backward's fix alone); +grad norm: the package's defaults")
    return f"{caption}\n\n{render_table(results)}"


def _write_readme(path: str, text: str) -> None:
    start, end = "<!-- bench:start -->", "<!-- bench:end -->"
    with open(path) as f:
        content = f.read()
    head, rest = content.split(start, 1)
    with open(path, "w") as f:
        f.write(f"{head}{start}\n{text}{end}{rest.split(end, 1)[1]}")
