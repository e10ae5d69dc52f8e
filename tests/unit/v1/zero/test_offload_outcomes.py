# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""What one inf does to an offload job: the outcome harness (:mod:`deepspeed_offload_patch.testing.outcomes`) names
each outcome, and on the installed release the recorded table (``docs/outcomes/<release>.json``, docs/releases.md)
is what a job does here, unpatched and patched.

The table records DeepSpeed's behaviour and the package's; these tests hold the harness and the record to the truth,
not the package to a verdict (where the package does not yet make a cell "skipped", the record says so).
"""

import json
import math
import os

import pytest
import torch

from deepspeed_offload_patch.settings import DISABLE
from deepspeed_offload_patch.testing import outcomes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


def _params(value: float) -> dict:
    return {"w": torch.full((2, ), value)}


def _rank(values, skipped=None) -> dict:
    """A rank's result: parameters before the first step and after each, one value per snapshot."""
    return {"params": [_params(v) for v in values], "skipped": skipped or [0] * (len(values) - 1)}


# Before the steps, then after steps 0 - 3; the fault is in step 1.
TRAINED = _rank([0.0, 1.0, 1.0, 2.0, 3.0], [0, 1, 1, 1])


@pytest.mark.parametrize(
    "ranks, outcome", [
        ([TRAINED, TRAINED], "skipped"),
        ([_rank([0.0, 1.0, math.nan, math.nan, math.nan])] * 2, "nan-weights"),
        ([_rank([0.0, 1.0, 2.0, 3.0, 4.0])] * 2, "applied"),
        ([{
            "error": "RuntimeError: x",
            "at": 1
        }] * 2, "crash"),
        ([{
            "error": "RuntimeError: x",
            "at": 1
        }, TRAINED], "ranks-disagree"),
        ([{
            "error": "RuntimeError: x",
            "at": 1
        }, {
            "error": "RuntimeError: y",
            "at": 2
        }], "ranks-disagree"),
        ([TRAINED, _rank([0.0, 1.0, 1.0, 2.0, 3.5])], "ranks-disagree"),
        ([TRAINED, None], "ranks-disagree"),
        ([_rank([0.0, 1.0, 1.0, 1.0, 1.0], [0, 1, 2, 3])] * 2, "freeze"),
    ],
    ids=["skipped", "nan", "applied", "crash", "one-raised", "two-errors", "differ", "hang", "freeze"])
def test_each_outcome_is_named(ranks, outcome):
    assert outcomes.classify(ranks)[0] == outcome


def test_ranks_that_both_hold_nan_weights_agree():
    """NaN weights on every rank are NaN weights, not ranks that disagree (a NaN is not equal to itself)."""
    nan = _rank([0.0, 1.0, math.nan, math.nan, math.nan])
    assert outcomes.classify([nan, _rank([0.0, 1.0, math.nan, math.nan, math.nan])])[0] == "nan-weights"


def _recorded() -> dict:
    import deepspeed
    from packaging.version import Version

    path = os.path.join(ROOT, "docs", "outcomes", f"{Version(deepspeed.__version__).base_version}.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {row["name"]: row for row in json.load(f)["cells"]}


RECORDED = _recorded()
#: One cell per stage, among them one whose inf reaches the weights on releases that apply it (bf16, check off).
HERE = ("s1-fp16-ga2-inf-one", "s2-bf16-off-ga1-inf-one", "s2-bf16-ga2-inf-one", "s3-fp32-ga1-inf-one",
        "s3-param-bf16-unset-ga2-inf-one")


@pytest.mark.skipif(not RECORDED, reason="no recorded outcome table for the installed DeepSpeed (nox -s outcomes)")
@pytest.mark.parametrize("side", ["unpatched", "patched"])
@pytest.mark.parametrize("name", HERE)
def test_the_recorded_outcome_is_what_happens_here(name, side):
    row = RECORDED[name]
    cell = next(cell for cell in outcomes.core_cells() if cell.name == name)
    outcome, detail, _ = outcomes.run_cell(cell, {DISABLE: "1" if side == "unpatched" else "0"}, fork_server=True)
    assert outcome == row[side], (detail, row[f"{side}_detail"])
