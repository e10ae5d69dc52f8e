# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The group layouts real jobs run, on 4 ranks: model-parallel groups (an ``mpu`` shaped like Megatron's) and
mixture-of-experts layers with expert parallelism.

* **2 data-parallel x 2 model-parallel**: model-parallel groups of adjacent ranks ([0, 1], [2, 3]), data-parallel
  groups strided ([0, 2], [1, 3]), each model-parallel rank with its own parameters. ZeRO partitions over the
  data-parallel group; ``has_overflow()`` all-reduces the flag over the model-parallel group too, so an inf on rank 3
  alone must make all four ranks skip the step. ZeRO-1 and ZeRO-2, bf16 with the check on and fp16 with dynamic loss
  scaling.
* **MoE**: DeepSpeed's ``MoE`` layer, 2 experts, expert parallelism 2 (expert data-parallel groups of 2 ranks), its
  parameters split into dense and expert groups as DeepSpeed requires; a fault in an expert's gradient on one rank
  and one in a dense gradient on another.

Each run trains in patched and in unpatched processes: parameters, fp32 master partitions, skipped steps, loss scale
and ``optimizer.overflow`` bit-identical on every rank (``equivalence``), the faults skipping exactly their steps.
The zero-sync test runs the patch as this process's switch says, so with the patch disabled it fails (the red/green
run, ``fails_unpatched``): unpatched DeepSpeed reads the host once per partition gradient in the boundary backward.
"""

import json
import os

import pytest

from deepspeed_offload_patch import GOOD_STATES
from deepspeed_offload_patch.testing.equivalence import (CURRENT, PATCHED, UNPATCHED, Fault, Run, both_sides,
                                                         bad_gradients_survive, boundary_syncs, differences,
                                                         fault_problems, run_side)

WORLD = 4
STEPS = 4
NUM_TENSORS = 12
# WithExperts' parameters: the chain's NUM_TENSORS, the gate's weight, then this rank's expert (weight, bias).
EXPERT_WEIGHT = NUM_TENSORS + 1
REPORTS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "reports", "scale")


def _faults(precision: str, first: Fault, second: Fault) -> tuple:
    # DeepSpeed 0.14.0 - 0.17.0 fail in step() on a bad bf16 gradient, patched or not (bad_gradients_survive).
    return (first, second) if bad_gradients_survive(precision) else ()


def _run(name: str, stage: int, precision: str, first: Fault, second: Fault, **layout) -> Run:
    return Run(f"{name}-s{stage}-{precision}",
               stage=stage,
               precision=precision,
               grad_accum=2,
               steps=STEPS,
               num_tensors=NUM_TENSORS,
               world_size=WORLD,
               faults=_faults(precision, first, second),
               **layout)


def _model_parallel(stage: int, precision: str) -> Run:
    return _run("2dp-2mp",
                stage,
                precision,
                Fault(1, "inf", rank=3, param=3),
                Fault(3, "nan", rank=0, param=6),
                model_parallel=2)


def _moe(stage: int, precision: str) -> Run:
    return _run("moe-ep2",
                stage,
                precision,
                Fault(1, "inf", rank=1, param=EXPERT_WEIGHT),
                Fault(3, "nan", rank=2, param=4),
                model="moe")


MODEL_PARALLEL = tuple(_model_parallel(stage, precision) for stage in (1, 2) for precision in ("bf16", "fp16"))
MOE = (_moe(1, "bf16"), _moe(2, "bf16"), _moe(2, "fp16"))
RUNS = MODEL_PARALLEL + MOE


def _train(side: str) -> list:
    """Every run on 4 ranks: the model-parallel runs and the MoE runs in processes of their own, because DeepSpeed
    keeps the last engine's ``mpu`` in a module global (``deepspeed.utils.groups.mpu``) that a later engine without
    one would take for its own."""
    results = run_side(side, MODEL_PARALLEL)
    for rank, more in zip(results, run_side(side, MOE)):
        rank["runs"].update(more["runs"])
    return results


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


def _report(sides) -> None:
    """Host syncs per boundary backward and seconds per run and rank, unpatched and patched, for ci/README.md."""
    import deepspeed

    rows = {}
    for run in RUNS:
        rows[run.name] = {
            side: {
                "boundary_syncs": boundary_syncs(result, run.name),
                "seconds": [round(rank["runs"][run.name]["seconds"], 1) for rank in result],
            }
            for side, result in sides.items()
        }
    os.makedirs(REPORTS, exist_ok=True)
    with open(os.path.join(REPORTS, f"{deepspeed.__version__}.json"), "w") as f:
        json.dump({"deepspeed": deepspeed.__version__, "world_size": WORLD, "runs": rows}, f, indent=1)


@pytest.mark.fails_unpatched
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_boundary_backward_makes_no_host_sync(current, run):
    syncs = boundary_syncs(current, run.name)
    assert len(syncs) == WORLD and all(len(rank) == STEPS for rank in syncs), syncs
    assert all(count == 0 for rank in syncs for count in rank), f"{run.name}: per rank, per step: {syncs}"


@pytest.mark.equivalence
def test_the_groups_are_the_ones_asked_for(sides):
    """Megatron's layout for the mpu runs; for MoE, the expert param groups reduce over expert data-parallel groups of
    2 ranks and the dense ones over all 4."""
    for result in sides.values():
        for rank, found in enumerate(result):
            assert found["state"] in GOOD_STATES + ("disabled", ), found["state"]
            for run in RUNS:
                groups = found["runs"][run.name]["groups"]
                if run.model_parallel > 1:
                    assert groups["model_parallel"] == [rank - rank % 2, rank - rank % 2 + 1], (run.name, groups)
                    assert set(map(tuple, groups["data_parallel"])) == {(rank % 2, rank % 2 + 2)}, (run.name, groups)
                else:
                    sizes = sorted(len(ranks) for ranks in groups["data_parallel"])
                    assert sizes[0] == 2 and sizes[-1] == WORLD, (run.name, groups)


@pytest.mark.equivalence
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_patched_and_unpatched_train_the_same_bits(sides, run):
    found = differences(sides[PATCHED], sides[UNPATCHED], run.name)
    assert not found, "\n".join(found[:10])


@pytest.mark.equivalence
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_every_rank_skips_the_faulty_steps(sides, run):
    """An inf or NaN on one rank makes all four skip the same steps (or, where DeepSpeed does not read the flag,
    train through them): patched and unpatched alike."""
    for side in (PATCHED, UNPATCHED):
        problems = fault_problems(run, sides[side])
        assert not problems, f"{side}: " + "\n".join(problems)


@pytest.mark.equivalence
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_unpatched_boundary_backward_reads_the_host(sides, run):
    """What the patch removes is there to remove: unpatched DeepSpeed makes host syncs in every boundary backward of
    every rank of these layouts."""
    syncs = boundary_syncs(sides[UNPATCHED], run.name)
    assert all(count > 0 for rank in syncs for count in rank), syncs
