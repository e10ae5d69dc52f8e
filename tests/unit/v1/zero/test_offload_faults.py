# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Bad gradients with the patch: every rank skips exactly the steps unpatched DeepSpeed skips, bit for bit, and the
next step trains (the flag was reset).

Each run trains on 2 ranks with the patch and without it (separate processes); both must be bit-identical at every
step (:mod:`deepspeed_offload_patch.testing.equivalence`), and the patched run must also skip what it should.
"""

import pytest
import torch

from deepspeed_offload_patch.testing.equivalence import PATCHED, UNPATCHED, Fault, Run, differences, run_side

pytestmark = pytest.mark.equivalence

SET_VALUES = [(value, via) for via in ("set-cpu", "set-device") for value in ("-inf", "nan", "inf")]

RUNS = (
    # One parameter on one rank: an inf at the boundary of step 1, a NaN at an inner micro-step of step 3.
    *(Run(f"one-rank-s{stage}",
          stage=stage,
          grad_accum=3,
          steps=5,
          faults=(Fault(1, "inf", rank=0, param=3), Fault(3, "nan", rank=1, param=5, micro=0))) for stage in (1, 2)),
    # -inf, NaN and inf through safe_set_full_grad, as CPU and as accelerator tensors, in consecutive steps 1-6.
    *(Run(f"safe-set-s{stage}",
          stage=stage,
          steps=8,
          faults=tuple(Fault(1 + i, value, rank=0, via=via) for i, (value, via) in enumerate(SET_VALUES)))
      for stage in (1, 2)),
    # Overflow in the very first step and the next one.
    Run("first-two-steps", stage=2, grad_accum=2, steps=4, faults=(Fault(0, "inf", rank=1), Fault(1, "nan", rank=0))),
    # Check off: the NaN is not detected and reaches the parameters, patched or not.
    Run("check-off", stage=2, precision="bf16-nocheck", steps=3, faults=(Fault(1, "nan", rank=0), )),
)
BY_NAME = {run.name: run for run in RUNS}


@pytest.fixture(scope="module")
def sides():
    return {side: run_side(side, RUNS) for side in (PATCHED, UNPATCHED)}


def _changed(before: dict, after: dict) -> bool:
    return any(not torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("name", list(BY_NAME))
def test_same_bits_as_unpatched(sides, name):
    found = differences(sides[PATCHED], sides[UNPATCHED], name)
    assert not found, "\n".join(found[:10])


@pytest.mark.parametrize("name", [run.name for run in RUNS if run.skips_bad_steps])
def test_every_rank_skips_the_bad_steps_and_trains_the_next(sides, name):
    run = BY_NAME[name]
    bad = {fault.step for fault in run.faults}
    for rank, result in enumerate(sides[PATCHED]):
        trace = result["runs"][name]
        before, skipped = trace["initial"], 0
        for step in trace["steps"]:
            where = f"rank {rank}, step {step['step']}"
            if step["step"] in bad:
                skipped += 1
                assert step["overflow"] == ("bool", True), where
                assert not _changed(before, step["params"]), f"{where}: parameters changed in a skipped step"
            else:
                assert step["overflow"] == ("bool", False), where
                assert _changed(before, step["params"]), f"{where}: the step after an overflow did not train"
            assert step["skipped"] == skipped, f"{where}: {step['skipped']} skipped, not {skipped}"
            assert not step["nan_params"], where
            before = step["params"]


def test_with_the_check_off_a_nan_reaches_the_parameters(sides):
    for result in sides[PATCHED]:
        steps = result["runs"]["check-off"]["steps"]
        assert [s["skipped"] for s in steps] == [0, 0, 0]
        assert not steps[0]["nan_params"] and steps[1]["nan_params"] and steps[2]["nan_params"]
