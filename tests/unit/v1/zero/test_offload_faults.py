# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Bad gradients with the patch: every rank skips exactly the steps unpatched DeepSpeed skips, bit for bit, and the
next step trains (the flag was reset).

Each run trains on 2 ranks with the patch and without it (separate processes); both must be bit-identical at every
step (:mod:`deepspeed_offload_patch.testing.equivalence`), and the patched run must also skip what it should. bf16
and fp16 alike; where ``step()`` does not read the bf16 flag (DeepSpeed before 0.17.1), bf16 runs train through
their faults, patched and unpatched alike. fp16 also overflows by itself, on every rank, from a large loss scale. Faults go only where DeepSpeed survives them
(:func:`~deepspeed_offload_patch.testing.equivalence.bad_gradients_survive`).
"""

import pytest
import torch

from deepspeed_offload_patch.testing.equivalence import (PATCHED, TRAINING_FIXED, UNPATCHED, Fault, Run,
                                                         bad_gradients_survive, reference_side, differences,
                                                         ranks_agree_on_overflow, run_side,
                                                         set_full_grad_reaches_tracker)

pytestmark = pytest.mark.equivalence

SET_VALUES = [(value, via) for via in ("set-cpu", "set-device") for value in ("-inf", "nan", "inf")]

RUNS = (
    # One parameter on one rank: an inf at the boundary of step 1, a NaN at an inner micro-step of step 3.
    *(Run(f"one-rank-{precision}-s{stage}",
          stage=stage,
          precision=precision,
          grad_accum=3,
          steps=5,
          faults=(Fault(1, "inf", rank=0, param=3), Fault(3, "nan", rank=1, param=5, micro=0)))
      for precision in ("bf16", "fp16") for stage in (1, 2) if bad_gradients_survive(precision)),
    # -inf, NaN and inf through safe_set_full_grad, as CPU and as accelerator tensors, in consecutive steps 1-6
    # (where safe_set_full_grad reaches the tracker: DeepSpeed 0.17.1 and later).
    *(Run(f"safe-set-{precision}-s{stage}",
          stage=stage,
          precision=precision,
          steps=8,
          faults=tuple(Fault(1 + i, value, rank=0, via=via) for i, (value, via) in enumerate(SET_VALUES)))
      for precision, stage in (("bf16", 1), ("bf16", 2), ("fp16", 2)) if set_full_grad_reaches_tracker()),
    # Overflow in the very first step and the next one.
    *(Run(f"first-two-steps-{precision}",
          stage=2,
          precision=precision,
          grad_accum=2,
          steps=4,
          faults=(Fault(0, "inf", rank=1), Fault(1, "nan", rank=0)))
      for precision in ("bf16", "fp16") if bad_gradients_survive(precision)),
    # Check off: the NaN is not detected and reaches the parameters, patched or not.
    *(Run("check-off", stage=2, precision="bf16-nocheck", steps=3, faults=(Fault(1, "nan", rank=0), ))
      for _ in range(bad_gradients_survive("bf16-nocheck"))),
    # fp16 from a loss scale of 2**24: the first steps overflow, the scale drops, then it trains. Not under ZeRO-1 on
    # 0.17.x, where an overflow that one rank's partition sees and the other's does not makes the ranks disagree and
    # abort, patched or not (ranks_agree_on_overflow).
    *(Run(
        f"fp16-scale-overflow-s{stage}", stage=stage, precision="fp16", grad_accum=2, steps=7, initial_scale_power=24)
      for stage in (1, 2) if ranks_agree_on_overflow(stage)),
)
SCALE_OVERFLOW = [run.name for run in RUNS if run.initial_scale_power == 24]
BY_NAME = {run.name: run for run in RUNS}


@pytest.fixture(scope="module")
def sides():
    found = {side: run_side(side, RUNS) for side in (PATCHED, UNPATCHED)}
    # ZeRO-2 over 3 micro-steps: where the release drops the middle one, the package's fix changes the bits on purpose
    # (reference_side: unpatched DeepSpeed with that fix alone).
    fixed = [run for run in RUNS if reference_side(run) == TRAINING_FIXED]
    if fixed:
        found[TRAINING_FIXED] = run_side(TRAINING_FIXED, fixed)
    return found


def _reference(run: Run) -> str:
    # The skipped-step fix does not reach these runs (no fp32 accumulation buffer): the accumulation fix may.
    return TRAINING_FIXED if reference_side(run) == TRAINING_FIXED else UNPATCHED


def _changed(before: dict, after: dict) -> bool:
    return any(not torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("name", list(BY_NAME))
def test_same_bits_as_unpatched(sides, name):
    found = differences(sides[PATCHED], sides[_reference(BY_NAME[name])], name)
    assert not found, "\n".join(found[:10])


@pytest.mark.parametrize("name", [run.name for run in RUNS if run.skips_bad_steps and run.name not in SCALE_OVERFLOW])
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


# Where DeepSpeed survives a NaN with the check off (not 0.14.0 - 0.17.0, whose step() fails on it, patched or not).
if bad_gradients_survive("bf16-nocheck"):

    def test_with_the_check_off_a_nan_reaches_the_parameters(sides):
        for result in sides[PATCHED]:
            steps = result["runs"]["check-off"]["steps"]
            assert [s["skipped"] for s in steps] == [0, 0, 0]
            assert not steps[0]["nan_params"] and steps[1]["nan_params"] and steps[2]["nan_params"]


@pytest.mark.parametrize("name", SCALE_OVERFLOW)
def test_the_loss_scale_overflows_on_every_rank_then_training_goes_on(sides, name):
    for rank, result in enumerate(sides[PATCHED]):
        steps = result["runs"][name]["steps"]
        skipped = [s["skipped"] for s in steps]
        scales = [float(s["scale"]["loss_scale"][1]) for s in steps]
        assert skipped[0] == 1 and 0 < skipped[-1] < len(steps), f"rank {rank}: skipped {skipped}"
        assert scales[-1] < 2**24 and scales == sorted(scales, reverse=True), f"rank {rank}: scales {scales}"
        assert skipped[-1] == skipped[-2], f"rank {rank}: still overflowing at the end ({skipped})"
        assert not steps[-1]["nan_params"], rank
