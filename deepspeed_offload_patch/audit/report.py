# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""``ds-offload-patch audit``'s numbers as people read them: the per-rank table, the top lines, budget checks.

Every function takes rank reports as :mod:`deepspeed_offload_patch.audit.rank` writes them (a list of dicts, one per
rank) and never imports DeepSpeed or torch, so rank 0 and the command that launched the run print the same text.
"""

from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

#: The phases of an optimizer step that each rank counts, in the order the tables show them.
PHASES = ("forward", "boundary_backward", "other_backward", "step")
#: Under the pipeline engine, the phases of one ``train_batch()``: its instructions by kind, and the rest
#: (:mod:`~deepspeed_offload_patch.audit.rank` says which instruction goes where). A report names its phases.
PIPELINE_PHASES = ("forward", "backward", "reduce_grads", "pipe_comm", "optimizer_step", "other")
#: Not a phase: all of them, the whole optimizer step (every micro-step's forward and backward, then step()).
WHOLE_STEP = "whole_step"
PHASE_TITLES = {
    "forward": "forward",
    "boundary_backward": "boundary backward",
    "other_backward": "other backward",
    "step": "step()",
    "backward": "backward",
    "reduce_grads": "ReduceGrads",
    "pipe_comm": "load, send, recv",
    "optimizer_step": "OptimizerStep",
    "other": "rest of train_batch",
    WHOLE_STEP: "whole step",
}
#: The columns of the tables: each phase, then the whole step.
COLUMNS = PHASES + (WHOLE_STEP, )

#: The budgets the command line can set: option -> the phases it limits.
BUDGET_PHASES = {
    "max_backward_syncs": ("boundary_backward", "other_backward"),
    "max_step_syncs": ("step", ),
    "max_total_syncs": (WHOLE_STEP, ),
}
#: The same under the pipeline engine: the backward budget covers the backward passes and ``ReduceGrads``, where the
#: pipeline reduces the gradients and ZeRO checks them (what the boundary backward does without a pipeline).
PIPELINE_BUDGET_PHASES = {
    "max_backward_syncs": ("backward", "reduce_grads"),
    "max_step_syncs": ("optimizer_step", ),
    "max_total_syncs": (WHOLE_STEP, ),
}


def phases_of(reports: List[Dict]) -> tuple:
    """The phases the reports count: a report names them (``phases``); one from before that field has
    :data:`PHASES`. Reports of different engines (not from one run) show the first one's."""
    return tuple(reports[0].get("phases") or PHASES) if reports else PHASES


def _columns_of(reports: List[Dict]) -> tuple:
    return phases_of(reports) + (WHOLE_STEP, )


def _fmt(values: Sequence[Optional[int]]) -> str:
    return " ".join(f"{'-' if v is None else v:>3}" for v in values)


def _count(counts: Optional[Dict[str, int]], phase: str) -> Optional[int]:
    if counts is None:
        return None
    return sum(counts.values()) if phase == WHOLE_STEP else counts.get(phase, 0)


def _column(report: Dict, phase: str) -> List[int]:
    return [_count(step, phase) for step in report["steps"]]


def _header(reports: List[Dict]) -> str:
    first = reports[0]
    counted = min(len(r["steps"]) for r in reports)
    partial = "" if all(r["complete"] for r in reports) else f" (the run ended after {counted})"
    wanted = first["steps_wanted"]
    return (
        f"first {wanted} optimizer step{'s' if wanted != 1 else ''}{partial}; DeepSpeed {first['deepspeed_version']}, "
        f"patch {first['patch_state']}")


def _rows(reports: List[Dict], run: Optional[str] = None, columns: Sequence[str] = COLUMNS) -> List[str]:
    rows = []
    for report in sorted(reports, key=lambda r: r["rank"]):
        cells = "".join(f"{_fmt(_column(report, phase)):<20} " for phase in columns)
        prefix = f"{run:<10} " if run is not None else ""
        rows.append(f"{prefix}{report['rank']:>4}  {cells.rstrip()}")
        if report.get("cuda_syncs"):
            cuda = "".join(f"{_fmt([_count(s, phase) for s in report['cuda_syncs']]):<20} " for phase in columns)
            rows.append(f"{' ' * len(prefix)}{'cuda':>4}  {cuda.rstrip()}")
    return rows


def _columns(with_run: bool, columns: Sequence[str] = COLUMNS) -> str:
    titles = "".join(f"{PHASE_TITLES[phase]:<20} " for phase in columns).rstrip()
    return f"{'run':<10} {'rank':>4}  {titles}" if with_run else f"{'rank':>4}  {titles}"


def _ranks_text(ranks: List[int]) -> str:
    """``0-3`` for consecutive ranks, else ``0,2``."""
    ranks = sorted(ranks)
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def nodes(reports: List[Dict]) -> Dict[Optional[int], List[Dict]]:
    """The reports by the node their launcher gave them (``node``; None where it gave none)."""
    found: Dict[Optional[int], List[Dict]] = {}
    for report in sorted(reports, key=lambda r: r["rank"]):
        found.setdefault(report.get("node"), []).append(report)
    return found


def node_table(reports: List[Dict]) -> str:
    """Host syncs per optimizer step summed over each node's ranks and over every rank that reported, one row each
    (a column per phase, one number per step), headed by how many of the world's ranks reported. Steps that not every
    rank of a row counted are left out of its sums."""
    world = max(r["world_size"] for r in reports)
    by_node = nodes(reports)
    columns = _columns_of(reports)
    lines = [
        "", f"[ds-offload-patch audit] host syncs per optimizer step, summed per node and over all: {len(reports)} of "
        f"{world} ranks reported, from {len(by_node)} node{'s' if len(by_node) != 1 else ''}",
        f"{'node':<6} {'ranks':<7} " + "".join(f"{PHASE_TITLES[phase]:<20} " for phase in columns).rstrip()
    ]
    groups = [(str(node), group) for node, group in by_node.items()] + [("all", reports)]
    for name, group in groups:
        steps = min(len(r["steps"]) for r in group)
        cells = "".join(f"{_fmt([sum(_count(r['steps'][i], phase) for r in group) for i in range(steps)]):<20} "
                        for phase in columns)
        lines.append(f"{name:<6} {_ranks_text([r['rank'] for r in group]):<7} {cells.rstrip()}")
    return "\n".join(lines)


def top_lines(reports: List[Dict], phase: str, limit: int = 3) -> List[str]:
    """The source lines with the most host syncs in ``phase`` (every phase for the whole step), summed over ranks:
    ``count  file:line (code)  op``."""
    totals: Counter = Counter()
    for report in reports:
        for part in (phases_of([report]) if phase == WHOLE_STEP else (phase, )):
            for entry in report["top"].get(part, ()):
                totals[(entry["line"], entry["op"])] += entry["count"]
    return [f"{count:>5}  {line}  {op}" for (line, op), count in totals.most_common(limit)]


def table(reports: List[Dict], top: int = 3) -> str:
    """The table rank 0 prints after the counted steps: one row per rank, a column per phase, and per phase the
    source lines with the most host syncs. ``cuda`` rows (CUDA only) count ``cuda*Synchronize`` calls."""
    lines = [
        "", f"[ds-offload-patch audit] host syncs per optimizer step (one number per step), {_header(reports)}",
        _columns(False, _columns_of(reports))
    ] + _rows(reports, columns=_columns_of(reports))
    lines.extend(kinds_lines(reports))
    lines.append("top lines per phase (host syncs summed over ranks and counted steps):")
    for phase in phases_of(reports):
        found = top_lines(reports, phase, top)
        lines.append(f"  {PHASE_TITLES[phase]}:" + ("" if found else " none"))
        lines.extend(f"    {line}" for line in found)
    return "\n".join(lines)


def kinds_lines(reports: List[Dict]) -> List[str]:
    """The whole step's host waits by kind, one line per rank (``rank 0: read   5   5   5, event wait  16  16  16``:
    one number per counted step; only the kinds seen). Empty for reports written before the kinds were counted."""
    reports = [report for report in reports if report.get("kinds")]
    if not reports:
        return []
    lines = ["host waits of the whole step by kind (one number per step; the phases above count the reads):"]
    for report in reports:
        kinds = [kind for kind in report["kinds"][0] if any(step.get(kind) for step in report["kinds"])]
        counts = ", ".join(f"{kind} {_fmt([step[kind] for step in report['kinds']])}" for kind in kinds)
        lines.append(f"  rank {report['rank']}: {counts or 'none'}")
    return lines


def compare_table(runs: Dict[str, List[Dict]], top: int = 3) -> str:
    """Runs side by side (``unpatched``, ``patched``), as ``ci/demo.sh`` prints them, with each run's top lines in
    each phase that has any."""
    lines = ["", "[ds-offload-patch audit --compare] host syncs per optimizer step (one number per step)"]
    for name, reports in runs.items():
        lines.append(f"  {name}: {_header(reports)}")
    columns = _columns_of(next((r for r in runs.values() if r), []))
    lines.append(_columns(True, columns))
    for name, reports in runs.items():
        lines.extend(_rows(reports, run=name, columns=columns))
    for name, reports in runs.items():
        for phase in phases_of(reports):
            found = top_lines(reports, phase, top)
            if found:
                lines.append(f"top lines, {name}, {PHASE_TITLES[phase]}:")
                lines.extend(f"    {line}" for line in found)
    return "\n".join(lines)


def _budget_phases(report: Dict, option: str) -> tuple:
    table = PIPELINE_BUDGET_PHASES if report.get("engine") == "pipeline" else BUDGET_PHASES
    return table[option]


@dataclass
class Violation:
    """One phase of one rank over its budget."""

    phase: str
    rank: int
    step: int
    count: int
    budget: int
    top: List[str]

    def __str__(self) -> str:
        where = "; ".join(line.strip() for line in self.top) or "no source line recorded"
        return (f"{PHASE_TITLES[self.phase]}: rank {self.rank} made {self.count} host syncs in optimizer step "
                f"{self.step} (budget {self.budget}); top lines: {where}")


def check_budgets(reports: List[Dict], budgets: Dict[str, Optional[int]], top: int = 3) -> List[Violation]:
    """The worst step of each rank and phase whose count is over its budget (``budgets`` maps the keys of
    :data:`BUDGET_PHASES` to a limit, or None for no limit; a pipeline engine's report is held to
    :data:`PIPELINE_BUDGET_PHASES`). Each violation names the rank's top lines there."""
    violations = []
    for option, limit in budgets.items():
        if limit is None:
            continue
        phases = dict.fromkeys(BUDGET_PHASES[option] + PIPELINE_BUDGET_PHASES[option])
        for phase in phases:
            for report in sorted(reports, key=lambda r: r["rank"]):
                if phase not in _budget_phases(report, option):
                    continue
                counts = _column(report, phase)
                if not counts or max(counts) <= limit:
                    continue
                worst = max(range(len(counts)), key=counts.__getitem__)
                violations.append(
                    Violation(phase, report["rank"], worst + 1, counts[worst], limit, top_lines([report], phase, top)))
    return violations
