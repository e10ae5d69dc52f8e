# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Sequence parallelism: DeepSpeed's Ulysses (``deepspeed.sequence.layer.DistributedAttention``) over a
sequence-parallel group of 2 ranks, with DeepSpeed's Ulysses ``mpu`` (``parallel_state_sp``), ZeRO-2 with the optimizer
offloaded to the CPU, gradient accumulation 2, bf16 (check on) with an inf and fp16 (dynamic loss scaling) with a NaN
in one micro-batch's backward on one rank (``ulysses_train.py``). gloo on the CPU runs its all-to-all
(``all_to_all_single``) in both precisions: the sequence-parallel attention equals the whole sequence's.

* ``fails_unpatched``: with the patch as this process's switch says, 0 host syncs in every boundary backward of both
  ranks (unpatched: one per gradient tensor of the rank's ZeRO partition).
* ``equivalence``: patched and unpatched processes train the same bits on both ranks (parameters, fp32 master
  partitions, losses, loss scale, gradient norm, ``optimizer.overflow``, the overflow flag) and skip the same step,
  exactly the faulty one; the groups and the attention are Ulysses's.

    python -m pytest -q tests/sequence
"""

import json
import os

import pytest

from deepspeed_offload_patch import GOOD_STATES
from deepspeed_offload_patch.testing.equivalence import CURRENT, PATCHED, UNPATCHED, both_sides, differences, side_env
from deepspeed_offload_patch.testing.launch import run_distributed
from ulysses_train import HEAD_DIM, HEADS, MICRO_BATCH, SEQUENCE, SEQUENCE_PARALLEL, WORLD, UlyssesRun, trace_ulysses

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
REPORT = os.path.join(ROOT, "reports", "sequence")

STEPS = 4
# (step, micro-batch, rank, value, parameter number): micro-batch 1 is the boundary (accumulation 2); parameter 2 is
# block 0's k.weight, 12 block 1's k.weight, so both faults reach the gradient through the all-to-all's backward.
RUNS = (
    UlyssesRun("bf16-inf", precision="bf16", steps=STEPS, fault=(1, 1, 1, "inf", 2)),
    UlyssesRun("fp16-nan", precision="fp16", steps=STEPS, fault=(2, 0, 0, "nan", 12)),
)
# The sequence-parallel attention against the whole sequence on one rank: the same math per head, so at most a
# rounding step of the low precision apart.
ATTENTION_TOLERANCE = 2e-2


def _train(side: str) -> list:
    return run_distributed(trace_ulysses, WORLD, args=(RUNS, ), env=side_env(side), fork_server=True)


@pytest.fixture(scope="module")
def current():
    """Every run, patched or not as ``DS_OFFLOAD_PATCH_DISABLE`` says."""
    return _train(CURRENT)


@pytest.fixture(scope="module")
def sides(current):
    """Every run in patched and in unpatched processes (the current run is the patched one when the switch is on)."""
    found = both_sides(_train, current)
    _report(found)
    return found


def _syncs(result: list, run: str) -> list:
    """Per rank, per step: the host syncs counted in the boundary backward."""
    return [[step["boundary_syncs"] for step in rank["runs"][run]["steps"]] for rank in result]


def _report(sides) -> None:
    """For the nox session's layout report (``ci/matrix_table.py``'s table): per run and side, the host syncs per rank
    and step in the boundary backward and each rank's seconds."""
    import deepspeed

    os.makedirs(REPORT, exist_ok=True)
    runs = {
        run.name: {
            side: {
                "boundary_syncs": _syncs(result, run.name),
                "seconds": [round(rank["runs"][run.name]["seconds"], 1) for rank in result],
            }
            for side, result in sides.items()
        }
        for run in RUNS
    }
    with open(os.path.join(REPORT, f"{deepspeed.__version__}.json"), "w") as f:
        json.dump({"deepspeed": deepspeed.__version__, "world_size": WORLD, "runs": runs}, f, indent=1)


@pytest.mark.fails_unpatched
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_boundary_backward_makes_no_host_sync(current, run):
    syncs = _syncs(current, run.name)
    assert len(syncs) == WORLD and all(len(rank) == STEPS for rank in syncs), syncs
    assert all(count == 0 for rank in syncs for count in rank), f"{run.name}: per rank, per step: {syncs}"


@pytest.mark.equivalence
def test_the_attention_is_ulysses_over_both_ranks(sides):
    """Both ranks form the sequence-parallel group, ZeRO partitions and reduces over it (no model-parallel group), the
    local attention sees the whole sequence with half of the heads, and its result equals the whole sequence's
    attention computed on one rank: gloo's all-to-all moved the right data, in bf16 and fp16."""
    for side, result in sides.items():
        for rank, found in enumerate(result):
            assert found["state"] in GOOD_STATES + ("disabled", ), found["state"]
            for run in RUNS:
                trace = found["runs"][run.name]
                assert trace["optimizer"] == "DeepSpeedZeroOptimizer", trace["optimizer"]
                assert trace["groups"] == {
                    "sequence_parallel": list(range(WORLD)),
                    "zero": list(range(WORLD)),
                    "model_parallel_group": False
                }, (side, rank, trace["groups"])
                attention = trace["attention"]
                assert attention["local_attention_saw"] == [
                    MICRO_BATCH, SEQUENCE, HEADS // SEQUENCE_PARALLEL, HEAD_DIM
                ], attention
                assert attention["max_difference"] <= ATTENTION_TOLERANCE, (side, rank, run.name, attention)


@pytest.mark.equivalence
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_patched_and_unpatched_train_the_same_bits(sides, run):
    assert {rank["state"] for rank in sides[PATCHED]} == {"applied"}
    assert {rank["state"] for rank in sides[UNPATCHED]} == {"disabled"}
    found = differences(sides[PATCHED], sides[UNPATCHED], run.name)
    assert not found, "\n".join(found[:10])


@pytest.mark.equivalence
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_both_ranks_skip_exactly_the_faulty_step(sides, run):
    """A fault in one micro-batch on one rank makes both ranks skip that step, and only it, patched and unpatched; no
    NaN reaches a parameter and the steps after it train."""
    fault_step = run.fault[0]
    for side, result in sides.items():
        for rank, found in enumerate(result):
            steps = found["runs"][run.name]["steps"]
            assert [s["skipped"] for s in steps] == [0] * fault_step + [1] * (STEPS - fault_step), (side, rank)
            assert not any(s["nan_params"] for s in steps), (side, rank)
            changed = [
                name for name, bits in steps[-1]["params"].items()
                if not bool((bits == steps[fault_step]["params"][name]).all())
            ]
            assert changed, f"{side}, rank {rank}: no parameter changed after the skipped step"


@pytest.mark.equivalence
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_unpatched_boundary_backward_reads_the_host(sides, run):
    """What the patch removes is there to remove: unpatched DeepSpeed makes host syncs in every boundary backward of
    both ranks under Ulysses."""
    syncs = _syncs(sides[UNPATCHED], run.name)
    assert all(count > 0 for rank in syncs for count in rank), syncs
