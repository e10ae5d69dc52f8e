# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""What one inf/NaN gradient does to an offload job, unpatched and with the package's defaults, as recorded.

``one_inf.json`` (beside this module; written by ``ci/outcomes_table.py`` from ``docs/outcomes/``) holds, for each
release recorded by ``nox -s outcomes``, the outcome of each job shape (ZeRO stage, ``offload_param``, precision,
accumulation 1 or 2) with an inf on one rank, and the releases each recorded one stands for: the defects of this
package's scope change only at 0.16.3, 0.17.1, 0.18.0, 0.19.3 and 0.19.8. :func:`outcome` looks a job up.
"""

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

from packaging.specifiers import SpecifierSet

from deepspeed_offload_patch.guard import release_of

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "one_inf.json")
#: What each recorded outcome means, as a sentence's end.
WORDS = {
    "skipped": "only that step is skipped, training goes on",
    "nan-weights": "the master weights turn NaN",
    "applied": "the step is applied from the bad gradient",
    "crash": "step() crashes",
    "ranks-disagree": "the ranks disagree (one skips, another steps) and the job hangs or aborts",
    "freeze": "every later step is skipped too (training freezes)",
}


@dataclass
class Outcome:
    """The recorded outcome of a job's shape: the cell, the release it was recorded on, and the two outcomes."""

    cell: str
    recorded_on: str
    unpatched: str
    patched: str

    def text(self) -> str:
        return (f"one inf/NaN in a step (recorded on DeepSpeed {self.recorded_on}, cell {self.cell}): unpatched, "
                f"{WORDS.get(self.unpatched, self.unpatched)}; with the package's defaults, "
                f"{WORDS.get(self.patched, self.patched)}")


def cell_key(stage: Any, offload_param: bool, precision: str, check: Optional[bool], grad_accum: Any) -> Optional[str]:
    """The recorded cell of a job shape (``s2-bf16-unset-ga2``), or None where the config leaves a factor to HF
    (``"auto"``) or outside the recorded ones (no ZeRO stage 1 - 3)."""
    if stage not in (1, 2, 3) or "auto" in (precision, check, grad_accum):
        return None
    if precision == "bf16":
        precision = {True: "bf16", False: "bf16-off", None: "bf16-unset"}[check]
    return f"s{stage}{'-param' if offload_param and stage == 3 else ''}-{precision}-ga{1 if grad_accum == 1 else 2}"


def outcome(version: Optional[str], key: Optional[str]) -> Optional[Outcome]:
    """The recorded outcome of cell ``key`` on the release that stands for DeepSpeed ``version``; None when either is
    unknown (a release past those recorded, a shape not recorded) or the table is not installed."""
    release = release_of(version) if version else None
    if release is None or key is None or not os.path.exists(DATA):
        return None
    with open(DATA) as f:
        data: Dict[str, Any] = json.load(f)
    for recorded, releases in data["stands_for"].items():
        if SpecifierSet(releases).contains(release):
            found = data["cells"].get(recorded, {}).get(key)
            return Outcome(key, recorded, *found) if found else None
    return None
