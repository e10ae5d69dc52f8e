# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Render docs/releases.md's one-inf table from the runs ``nox -s outcomes`` wrote (``docs/outcomes/<release>.json``).

One row per ZeRO stage and precision, one column per release; each entry is ``unpatched → patched``, once where
gradient accumulation 1 and 2 agree, else for each (``ga1 ...; ga2 ...``). ``--check`` writes nothing and exits 1
when the document holds another table.

    python ci/outcomes_table.py            # rewrite the table in docs/releases.md
    python ci/outcomes_table.py --check
"""

import os
import sys

from oracle_table import ROOT, cli

RUNS = os.path.join(ROOT, "docs", "outcomes")
PRECISIONS = {
    "bf16": "bf16, check_grad_overflow true",
    "bf16-off": "bf16, check_grad_overflow false",
    "bf16-unset": "bf16, check_grad_overflow left out",
    "fp16": "fp16",
    "fp32": "fp32",
}


def _row_key(cell: dict) -> tuple:
    return f"ZeRO-{cell['stage']}" + (" + offload_param" if cell["offload_param"] else ""), cell["precision"]


def _outcome(outcome: str) -> str:
    return outcome if outcome == "skipped" else f"**{outcome}**"


def _entry(cells: list) -> str:
    said = {cell["grad_accum"]: f"{_outcome(cell['unpatched'])} → {_outcome(cell['patched'])}" for cell in cells}
    if len(set(said.values())) == 1:
        return next(iter(said.values()))
    return "; ".join(f"ga{grad_accum} {text}" for grad_accum, text in sorted(said.items()))


def _other_faults(runs: dict) -> list:
    """Lines for the releases recorded with ``--every``: the cells where a NaN, or a fault on every rank, comes out
    otherwise than the inf on rank 0 of the same job."""
    lines = []
    for release, run in runs.items():
        base = {
            (row["stage"], row["offload_param"], row["precision"], row["grad_accum"]): row
            for row in run["cells"] if row["fault"] == "inf" and not row["every_rank"]
        }
        others = [row for row in run["cells"] if row["fault"] != "inf" or row["every_rank"]]
        if not others:
            continue
        differ = []
        for row in others:
            same = base.get((row["stage"], row["offload_param"], row["precision"], row["grad_accum"]))
            if same is None or (row["unpatched"], row["patched"]) != (same["unpatched"], same["patched"]):
                differ.append(f"`{row['name']}` {_outcome(row['unpatched'])} → {_outcome(row['patched'])}")
        said = "; ".join(differ) if differ else "none"
        lines += [
            "", f"{release}, a NaN and faults on every rank too ({len(others)} cells more): where the outcome "
            f"differs from the inf on rank 0: {said}."
        ]
    return lines


def table(runs: dict) -> str:
    """The markdown table of ``runs`` (``oracle_table.load`` of docs/outcomes)."""
    if not runs:
        return "(no run recorded: `nox -s outcomes`)"
    rows: dict = {}
    for release, run in runs.items():
        for cell in run["cells"]:
            if cell["fault"] == "inf" and not cell["every_rank"]:
                rows.setdefault(_row_key(cell), {}).setdefault(release, []).append(cell)
    releases = list(runs)
    lines = ["| job | " + " | ".join(releases) + " |", "| --- |" + " --- |" * len(releases)]
    for (stage, precision), by_release in rows.items():
        entries = [_entry(by_release[release]) if release in by_release else "-" for release in releases]
        lines.append(f"| {stage}, {PRECISIONS[precision]} | " + " | ".join(entries) + " |")
    lines += _other_faults(runs)
    first = next(iter(runs.values()))
    lines.append("")
    lines.append(f"(unpatched → patched; an inf in one gradient element on rank 0 at step {first['fault_step']} of "
                 f"{first['steps']}, {first['world_size']} ranks, `offload_optimizer`, torch AdamW; torch "
                 f"{', '.join(sorted({run['torch'] for run in runs.values()}))})")
    return "\n".join(lines)


def main(argv=None) -> int:
    return cli(argv, "outcomes", table, RUNS, "one-inf table")


if __name__ == "__main__":
    sys.exit(main())
