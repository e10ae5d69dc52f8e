# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Render docs/releases.md's oracle table from the runs ``nox -s oracle`` wrote (``docs/oracle/<release>.json``).

One row per ZeRO stage and way of accumulating, one column per release; each entry is ``unpatched → patched`` over
the row's four cells (clipping on and off, fp32 and bf16): ``right`` when all are, else how many are wrong, raised
(``error``) or came out differently run to run (``unstable``). ``--check`` writes nothing and exits 1 when the
document holds another table.

    python ci/oracle_table.py            # rewrite the table in docs/releases.md
    python ci/oracle_table.py --check
"""

import argparse
import glob
import json
import os
import sys
from collections import Counter

from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(ROOT, "docs", "oracle")
DOC = os.path.join(ROOT, "docs", "releases.md")


def load(folder: str = RUNS) -> dict:
    """``{release: run}`` of every ``<release>.json`` in ``folder``, oldest release first."""
    runs = {}
    for path in glob.glob(os.path.join(folder, "*.json")):
        with open(path) as f:
            run = json.load(f)
        runs[run["deepspeed"].strip()] = run
    return dict(sorted(runs.items(), key=lambda item: Version(item[0])))


def _row_key(cell: dict) -> tuple:
    way = f"{cell['backwards']} backwards per step" if cell["backwards"] > 1 else f"accumulation {cell['grad_accum']}"
    stage = f"ZeRO-{cell['stage']}" + (" + offload_param" if cell["offload_param"] else "")
    return stage, way


def _summary(outcomes: list) -> str:
    counts = Counter(outcomes)
    if set(counts) == {"right"}:
        return "right"
    return ", ".join(f"**{kind}** {n}/{len(outcomes)}" for kind, n in sorted(counts.items()) if kind != "right")


def table(runs: dict) -> str:
    """The markdown table of ``runs`` (:func:`load`)."""
    if not runs:
        return "(no oracle run recorded: `nox -s oracle`)"
    rows: dict = {}
    for release, run in runs.items():
        for cell in run["cells"]:
            entry = rows.setdefault(_row_key(cell), {}).setdefault(release, {"unpatched": [], "patched": []})
            for side in entry:
                entry[side].append(cell[side])
    releases = list(runs)
    heads = [f"{release} (x{runs[release].get('repeats', 1)})" for release in releases]
    lines = ["| job | " + " | ".join(heads) + " |", "| --- |" + " --- |" * len(releases)]
    for (stage, way), by_release in rows.items():
        entries = []
        for release in releases:
            found = by_release.get(release)
            entries.append("-" if found is None else f"{_summary(found['unpatched'])} → {_summary(found['patched'])}")
        lines.append(f"| {stage}, {way} | " + " | ".join(entries) + " |")
    first = next(iter(runs.values()))
    lines.append("")
    lines.append(f"(unpatched → patched; each entry over 4 cells: clipping on/off x fp32/bf16, each trained as many "
                 f"times as the column says (x2: twice) on {first['world_size']} ranks; torch "
                 f"{', '.join(sorted({run['torch'] for run in runs.values()}))})")
    waited = [release for release, run in runs.items() if run.get("zero3_gather_wait")]
    if waited:
        lines.append("")
        lines.append(f"(ZeRO-3 on {', '.join(waited)}: every parameter all-gather waited for, as 0.19.8 does itself: "
                     f"`testing/zero3_gather.py`)")
    return "\n".join(lines)


def write_block(doc: str, name: str, text: str, check: bool) -> int:
    """Put ``text`` between ``<!-- name:start -->`` and ``<!-- name:end -->`` in ``doc``; with ``check``, write
    nothing and return 1 when the document holds something else there. Returns 1 when the markers are missing."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    with open(doc) as f:
        old = f.read()
    if start not in old or end not in old:
        print(f"{doc} has no {start} ... {end} block")
        return 1
    head, rest = old.split(start, 1)
    _, tail = rest.split(end, 1)
    new = f"{head}{start}\n{text}\n{end}{tail}"
    if check:
        if new != old:
            print(f"{doc}: the {name} table differs from the recorded runs; run the script without --check")
            return 1
        return 0
    with open(doc, "w") as f:
        f.write(new)
    return 0


def cli(argv, name: str, render, folder: str, what: str) -> int:
    """The command line of a table script: ``render(load(folder))`` into docs/releases.md's ``name`` block, or with
    ``--check`` exit 1 when the block holds something else."""
    parser = argparse.ArgumentParser(description=f"Render docs/releases.md's {what} from {folder}.")
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/releases.md holds another table")
    args = parser.parse_args(argv)
    runs = load(folder)
    code = write_block(DOC, name, render(runs), args.check)
    if not code and not args.check:
        print(f"wrote the {what} of {len(runs)} releases into {DOC}")
    return code


def main(argv=None) -> int:
    return cli(argv, "oracle", table, RUNS, "oracle table")


if __name__ == "__main__":
    sys.exit(main())
