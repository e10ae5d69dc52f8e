# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Render docs/releases.md's one-inf table from the runs ``nox -s outcomes`` wrote (``docs/outcomes/<release>.json``),
and the package's ``one_inf.json``, from which ``affected`` names a job's outcome.

One row per ZeRO stage and precision, one column per release; each entry is ``unpatched → patched``, once where
gradient accumulation 1 and 2 agree, else for each (``ga1 ...; ga2 ...``). ``--check`` writes nothing and exits 1
when the document holds another table, or the package's file other data.

    python ci/outcomes_table.py            # rewrite the table in docs/releases.md
    python ci/outcomes_table.py --check
"""

import json
import os
import re
import sys

from oracle_table import ROOT, cli, load

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


#: The releases each recorded one stands for in ``affected`` (the package's ``one_inf.json``): the outcomes change
#: only where a defect of the package's scope comes or goes (0.16.3: the L2 norm's form; 0.17.1: bf16's check and a
#: float norm sentinel; 0.18.0: ZeRO-1's ranks agree; 0.19.3: bf16's check on by default; 0.19.8: every one fixed).
STANDS_FOR = {
    "0.14.4": ">=0.14.0,<0.16.3",
    "0.16.9": ">=0.16.3,<0.17.1",
    "0.17.6": ">=0.17.1,<0.18.0",
    "0.18.9": ">=0.18.0,<0.19.3",
    "0.19.7": ">=0.19.3,<0.19.8",
    "0.19.8": "==0.19.8",
}
DATA = os.path.join(ROOT, "deepspeed_offload_patch", "one_inf.json")


def compact(runs: dict) -> str:
    """The package's ``one_inf.json``: each recorded release's cells with an inf on rank 0, ``[unpatched, patched]``
    by the job's shape (the cell's name without its fault), and :data:`STANDS_FOR`."""
    cells = {
        release: {
            cell["name"].rsplit("-inf-one", 1)[0]: [cell["unpatched"], cell["patched"]]
            for cell in run["cells"] if cell["fault"] == "inf" and not cell["every_rank"]
        }
        for release, run in runs.items()
    }
    text = json.dumps({"stands_for": STANDS_FOR, "cells": cells}, indent=1, sort_keys=True)
    return re.sub(r'\[\s+("[^"]+"),\s+("[^"]+")\s+\]', r"[\1, \2]", text) + "\n"  # a cell on one line


def main(argv=None) -> int:
    code = cli(argv, "outcomes", table, RUNS, "one-inf table")
    text = compact(load(RUNS))
    if "--check" in (sys.argv[1:] if argv is None else argv):
        same = os.path.exists(DATA) and open(DATA).read() == text
        if not same:
            print(f"{DATA} differs from {RUNS}: run {__file__}")
        return code or (0 if same else 1)
    with open(DATA, "w") as f:
        f.write(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
