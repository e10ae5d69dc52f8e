# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The phase-time tables of ci/README.md, from the lines timed ``.ci/run`` runs wrote (``reports/ci-times.txt``),
kept as ``ci/ci-times.txt`` (an idle machine) and ``ci/ci-times-loaded.txt`` (another CPU-heavy job beside it the
whole time).

``python ci/ci_times.py`` prints the tables; ``tests/unit/test_docs.py`` checks that ci/README.md holds them. Two runs
of the same phases share one table (a column each); runs of different phases (different commits) get a table each.
"""

import os
import re
import sys
from typing import List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = (("idle", "ci-times.txt"), ("loaded", "ci-times-loaded.txt"))

Row = Tuple[int, int, str]


def read(name: str) -> List[Row]:
    """``(seconds, total, phase)`` per line of ``ci/<name>``."""
    with open(os.path.join(HERE, name)) as f:
        return [(int(m.group(1)), int(m.group(2)), m.group(3))
                for m in re.finditer(r"^(\d+) s \(total (\d+) s\): (.+)$", f.read(), re.M)]


def _total(rows: List[Row]) -> str:
    return f"**{rows[-1][1]} s ({rows[-1][1] / 60:.1f} min)**"


def tables() -> str:
    """The Markdown of the tables."""
    runs = [(label, read(name)) for label, name in RUNS]
    phases = [[phase for _, _, phase in rows] for _, rows in runs]
    if all(names == phases[0] for names in phases):
        lines = ["| phase | " + " | ".join(label for label, _ in runs) + " |", "| --- |" + " --- |" * len(runs)]
        for i, phase in enumerate(phases[0]):
            lines.append(f"| `{phase}` | " + " | ".join(f"{rows[i][0]} s" for _, rows in runs) + " |")
        lines.append("| **total** | " + " | ".join(_total(rows) for _, rows in runs) + " |")
        return "\n".join(lines) + "\n"
    out = []
    for label, rows in runs:
        lines = [f"| phase | {label} |", "| --- | --- |"]
        lines += [f"| `{phase}` | {seconds} s |" for seconds, _, phase in rows]
        lines.append(f"| **total** | {_total(rows)} |")
        out.append("\n".join(lines) + "\n")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(tables())
