# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""One overflow must not freeze training: the skipped-step fix (DeepSpeed 0.19.8, fp32 gradient accumulation).

DeepSpeed 0.19.8 accumulates fp32 gradients (``grad_accum_dtype: fp32`` under bf16 or fp16) in a compact partition
buffer. With the optimizer offloaded, a step skipped for an inf/NaN leaves the inf/NaN in that buffer, and every
later step is skipped too. The oracle is unpatched DeepSpeed without that defect (``reference_side``): at ZeRO-1 with
the buffer turned off (``BUFFER_OFF``), which accumulates as releases before 0.19.8 did; at ZeRO-2, where turning the
buffer off changes the bits even without a fault (measured: the fp32 master partitions differ from the first step),
with the harness zeroing the buffer after each skipped step (``CLEARED_AFTER_SKIP``). Without a fault each oracle
trains the same bits as unpatched DeepSpeed (``test_the_oracle_is_sound``); with one it skips the faulty steps only.
The package (``CURRENT``: the red/green run disables it) must train every run here bit-identically to its oracle,
every rank, every step: parameters, fp32 master partitions, skipped steps, ``optimizer.overflow``, the loss scale.
Unpatched DeepSpeed, and the package with only the upstream change (``DS_OFFLOAD_PATCH_UPSTREAM_ONLY=1``), keep
skipping. The same holds in the 4-rank layouts of ``test_offload_scale.py`` (2 data-parallel x 2 model-parallel with
a Megatron-shaped ``mpu``, and MoE with expert parallelism 2, a fault in an expert's gradient). A checkpoint saved
right after a skipped step resumes as the run that was never interrupted.

Not collected on releases without the compact buffer (before 0.19.8): there the package reports the fix
``not-needed`` (``tests/unit/test_skipped_step.py``).
"""

import dataclasses

import pytest

from deepspeed_offload_patch.testing.equivalence import (BUFFER_OFF, CLEARED_AFTER_SKIP, CURRENT, UNPATCHED,
                                                         UPSTREAM_ONLY, Fault, Run, differences, fault_problems,
                                                         reference_side, run_side)

STEPS = 6
FP32 = "fp32"
# ZeRO-1 and ZeRO-2, bf16 (its check on, the default) and fp16 (dynamic loss scale), gradient accumulation 2 in fp32:
# a fault on one rank at the boundary, on every rank at the inner micro-step, two in a row, and two apart.
RUNS = (
    Run("s1-bf16-one-rank", stage=1, grad_accum=2, steps=STEPS, grad_accum_dtype=FP32, faults=(Fault(1, "inf"), )),
    Run("s2-bf16-every-rank-inner",
        stage=2,
        grad_accum=2,
        steps=STEPS,
        grad_accum_dtype=FP32,
        faults=(Fault(1, "nan", rank=None, micro=0), )),
    Run("s1-fp16-two-in-a-row",
        stage=1,
        grad_accum=2,
        steps=STEPS,
        precision="fp16",
        grad_accum_dtype=FP32,
        faults=(Fault(1, "inf", rank=1, param=4), Fault(2, "nan", rank=0, param=7))),
    Run("s2-fp16-two-apart",
        stage=2,
        grad_accum=2,
        steps=STEPS,
        precision="fp16",
        grad_accum_dtype=FP32,
        faults=(Fault(1, "-inf", rank=0, param=2), Fault(4, "inf", rank=1, param=9, micro=0))),
)
# One run per stage without its faults: what each oracle must train as unpatched DeepSpeed does.
CLEAN = tuple(dataclasses.replace(run, name=f"{run.name}-no-fault", faults=()) for run in RUNS[:2])
SAVED = Run("s2-bf16-saved-after-the-skip",
            stage=2,
            grad_accum=2,
            steps=STEPS,
            grad_accum_dtype=FP32,
            save_after=2,
            faults=(Fault(1, "inf"), ))

# The 4-rank layouts, each in processes of its own (DeepSpeed keeps an engine's ``mpu`` in a module global): a fault on
# the last rank of the second model-parallel group at ZeRO-1 bf16, and one in an expert's gradient at ZeRO-2 fp16.
LAYOUTS = (
    Run("2dp-2mp-s1-bf16",
        stage=1,
        grad_accum=2,
        steps=4,
        grad_accum_dtype=FP32,
        world_size=4,
        model_parallel=2,
        faults=(Fault(1, "inf", rank=3, param=3), )),
    Run("moe-ep2-s2-fp16",
        stage=2,
        grad_accum=2,
        steps=4,
        precision="fp16",
        grad_accum_dtype=FP32,
        world_size=4,
        model="moe",
        faults=(Fault(1, "inf", rank=1, param=13), )),  # 13: this rank's expert weight (test_offload_scale.py)
)

_layouts = {}


def _layout(run: Run, side: str) -> list:
    """``run`` on ``side``, once per module (the red/green run needs only the current side: it fails there first)."""
    if (run.name, side) not in _layouts:
        _layouts[(run.name, side)] = run_side(side, [run])
    return _layouts[(run.name, side)]


@pytest.fixture(scope="module")
def sides():
    found = {side: run_side(side, RUNS + CLEAN) for side in (CURRENT, UNPATCHED)}
    for side in (BUFFER_OFF, CLEARED_AFTER_SKIP):
        found[side] = run_side(side, [run for run in RUNS + CLEAN if _oracle(run) == side])
    return found


def _oracle(run: Run) -> str:
    """The reference of ``run``, or for a run without faults the reference of its faulty twin."""
    return reference_side(run if run.faults else dataclasses.replace(run, faults=(Fault(1, "inf"), )))


@pytest.mark.fails_unpatched
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_a_skipped_step_leaves_nothing_behind(sides, run):
    """Bit-identical to the oracle on every rank and step, and exactly the faulty steps skipped."""
    found = differences(sides[CURRENT], sides[_oracle(run)], run.name)
    assert not found, "\n".join(found[:10])
    assert sides[CURRENT][0]["skipped_step"] == "applied", sides[CURRENT][0]["skipped_step"]
    problems = fault_problems(run, sides[CURRENT])
    assert not problems, "\n".join(problems)


@pytest.mark.equivalence
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_unpatched_deepspeed_keeps_skipping(sides, run):
    """The defect the fix answers, in these very runs: every step from the first faulty one is skipped."""
    first = min(fault.step for fault in run.faults)
    for number, rank in enumerate(sides[UNPATCHED]):
        skipped = [step["skipped"] for step in rank["runs"][run.name]["steps"]]
        assert skipped[-1] == STEPS - first, f"rank {number}: skipped counts {skipped}"
    assert any("skipped" in line for line in differences(sides[UNPATCHED], sides[_oracle(run)], run.name))


@pytest.mark.equivalence
@pytest.mark.parametrize("run", CLEAN, ids=lambda run: run.name)
def test_the_oracle_is_sound(sides, run):
    """Without a fault, the oracle trains the same bits as unpatched DeepSpeed, and the fix changes none of them."""
    found = differences(sides[UNPATCHED], sides[_oracle(run)], run.name)
    found += differences(sides[CURRENT], sides[UNPATCHED], run.name)
    assert not found, "\n".join(found[:10])


@pytest.mark.equivalence
def test_upstream_only_leaves_exactly_the_upstream_change(sides):
    """``DS_OFFLOAD_PATCH_UPSTREAM_ONLY=1``: the flag fix alone, so a faulty run trains as unpatched DeepSpeed."""
    run = RUNS[0]
    upstream = run_side(UPSTREAM_ONLY, [run])
    assert upstream[0]["state"] == "applied" and upstream[0]["skipped_step"] == "off", upstream[0]["skipped_step"]
    found = differences(upstream, sides[UNPATCHED], run.name)
    assert not found, "\n".join(found[:10])


@pytest.mark.fails_unpatched
@pytest.mark.parametrize("run", LAYOUTS, ids=lambda run: run.name)
def test_the_layouts_skip_only_the_faulty_step(run):
    """4 ranks: bit-identical to the oracle on every rank, and the step after the fault updates on every rank."""
    current = _layout(run, CURRENT)
    assert len(current) == 4 and current[0]["skipped_step"] == "applied", current[0]["skipped_step"]
    problems = fault_problems(run, current) + differences(current, _layout(run, reference_side(run)), run.name)
    assert not problems, "\n".join(problems[:10])


@pytest.mark.equivalence
@pytest.mark.parametrize("run", LAYOUTS, ids=lambda run: run.name)
def test_unpatched_layouts_keep_skipping(run):
    """Unpatched, every rank of the layout skips every step from the fault on."""
    for number, rank in enumerate(run_side(UNPATCHED, [run])):
        skipped = [step["skipped"] for step in rank["runs"][run.name]["steps"]]
        assert skipped[-1] == run.steps - run.faults[0].step, f"rank {number}: skipped counts {skipped}"


@pytest.mark.fails_unpatched
def test_a_checkpoint_saved_after_a_skipped_step_trains_on_identically(tmp_path):
    """Saved right after the skipped step, loaded into a fresh engine: the same bits as the run never interrupted
    (unpatched, the interrupted run drops the stuck buffer on load and so differs from its own uninterrupted run)."""
    saved = run_side(CURRENT, [SAVED], save_root=str(tmp_path))
    resumed = run_side(CURRENT, [SAVED], load_root=str(tmp_path))
    found = differences(resumed, saved, SAVED.name, part="resumed", b_part="runs", from_step=SAVED.save_after)
    assert not found, "\n".join(found[:10])
    assert not fault_problems(SAVED, saved)
