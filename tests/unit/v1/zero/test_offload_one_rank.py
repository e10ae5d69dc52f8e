# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Patched and unpatched DeepSpeed train bit-identically on one rank: the equivalence runs that need no second rank
(bf16, fp16 and fp32, ZeRO-1 and ZeRO-2, an inf at step 1 where DeepSpeed survives one). ``ci/gpu-check.sh`` runs
them on one CUDA GPU, where two ranks cannot share the device; here they run on the CPU like the rest. Where the
package's invalid-norm fix skips an fp32 step that DeepSpeed applies (0.17.1 - 0.19.7), the patched bits are those of
unpatched DeepSpeed with that fix alone (``reference_side``)."""

import pytest

from deepspeed_offload_patch.testing.equivalence import (PATCHED, TRAINING_FIXED, UNPATCHED, Fault, Run,
                                                         bad_gradients_survive, differences, reference_side, run_side,
                                                         skips_in, training_fixes)

pytestmark = pytest.mark.equivalence

RUNS = tuple(
    Run(f"one-rank-{precision}-s{stage}",
        stage=stage,
        precision=precision,
        grad_accum=2,
        steps=4,
        faults=(Fault(1, "inf", rank=0), ) if bad_gradients_survive(precision) else ())
    for precision in ("bf16", "fp16", "fp32") for stage in (1, 2))


@pytest.fixture(scope="module")
def sides():
    found = {side: run_side(side, RUNS, world_size=1) for side in (PATCHED, UNPATCHED)}
    fixed = [run for run in RUNS if reference_side(run) == TRAINING_FIXED]
    if fixed:
        found[TRAINING_FIXED] = run_side(TRAINING_FIXED, fixed, world_size=1)
    return found


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_same_bits_as_unpatched_on_one_rank(sides, run):
    found = differences(sides[PATCHED], sides[reference_side(run)], run.name)
    assert not found, "\n".join(found[:10])
    if reference_side(run) == TRAINING_FIXED:
        # Not a vacuous reference: where a fix reaches the run, unpatched DeepSpeed trains other bits.
        assert bool(differences(sides[UNPATCHED], sides[TRAINING_FIXED], run.name)) == bool(training_fixes(run))


@pytest.mark.parametrize("run", [run for run in RUNS if run.faults], ids=lambda run: run.name)
def test_the_fault_did_what_it_should_on_one_rank(sides, run):
    steps = sides[PATCHED][0]["runs"][run.name]["steps"]
    skipped = [step["skipped"] for step in steps]
    if skips_in(run, sides[PATCHED]):
        assert skipped == [0, 1, 1, 1], f"{run.name}: skipped {skipped}"
        assert not steps[-1]["nan_params"], run.name
    else:
        assert skipped == [0, 0, 0, 0] and steps[-1]["nan_params"], f"{run.name}: skipped {skipped}"
