# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Patched and unpatched DeepSpeed train bit-identically, across the ZeRO-1/2 offload configurations users run.

Each run trains on 2 ranks, once in processes with the patch and once in processes without it, and every optimizer
step's parameters, fp32 master partitions, skipped-step count, ``optimizer.overflow`` and loss scale state must be
identical, bits and Python types (:mod:`deepspeed_offload_patch.testing.equivalence`). Where the skipped-step fix
changes a run (a fault, with fp32 gradient accumulation on DeepSpeed 0.19.8, which keeps it in its compact buffer and
skips every later step), the reference is unpatched DeepSpeed without that defect: with the buffer turned off at
ZeRO-1, with the buffer zeroed after each skipped step at ZeRO-2. Where a fix that corrects training reaches a run
(ZeRO-2 over 3 micro-steps on releases that drop the middle ones; an fp32 fault that DeepSpeed 0.17.1 - 0.19.7 apply),
it is unpatched DeepSpeed with that fix alone
(:func:`~deepspeed_offload_patch.testing.equivalence.reference_side`).

The configurations are a pairwise covering array, not the full product (4 x 3 x 2^6 = 768 runs): every pair of
values of any two factors appears in at least one of the 12 runs of ``PAIRWISE``, which
``test_the_runs_cover_every_pair`` checks. Gradient accumulation in fp32 (``grad_accum_dtype``; at ZeRO-1 DeepSpeed
keeps it in a per-parameter attribute, another path to the tracker) is one of the factors. Most interactions that
break code involve one or two factors; the two
many-valued factors (precision and model) are crossed in full. bf16, bf16 with the check off, fp32 and fp16 (loss
scale 2**8) all get an inf on one rank at a boundary and a NaN on the other rank (at an inner micro-step where there
is one), except bf16 with the check off, whose NaN comes in the last step: runs that skip bad steps (fp16; bf16 with
the check on from 0.17.1; fp32 from 0.19.8 through its gradient norm, and patched before it through the invalid-norm
fix) must skip exactly those steps, the others train through them. ZenFlow (DeepSpeed 0.17.6 and later) adds one run. ZenFlow skips steps of its own on the
CPU, patched or not (after an overflow on 0.19.8; on 0.18.x its parameters go to NaN and it skips from the second
step), so its only fault is in its last step, which must be skipped.
"""

import itertools

import pytest

from deepspeed_offload_patch import GOOD_STATES
from deepspeed_offload_patch.testing.equivalence import (BUFFER_OFF, CLEARED_AFTER_SKIP, GRAD_ACCUM_DTYPES, PATCHED,
                                                         TRAINING_FIXED, PRECISIONS, UNPATCHED, Fault, Run,
                                                         bad_gradients_survive, boundary_syncs, differences,
                                                         fault_problems, invalid_norm_skips_step, per_param_tracker,
                                                         reference_side, run_side, training_fixes, zenflow_available)
from deepspeed_offload_patch.testing.launch import DistributedFailure

pytestmark = pytest.mark.equivalence

STEPS = 5
FACTORS = {
    "precision": PRECISIONS,
    "model": ("plain", "sometimes-unused", "param-groups"),  # MoE runs with its groups in test_offload_scale.py
    "stage": (1, 2),
    "grad_accum": (1, 3),
    "overlap_comm": (False, True),
    "contiguous_gradients": (False, True),
    "reduce_scatter": (False, True),
    "grad_accum_dtype": GRAD_ACCUM_DTYPES,
}
SHORT = {"grad_accum": "accum", "grad_accum_dtype": "accum_dtype"}
# precision, model, stage, grad_accum, overlap_comm, contiguous_gradients, reduce_scatter, grad_accum_dtype
_ROWS = (
    ("bf16", "plain", 1, 1, True, False, False, None),
    ("bf16", "sometimes-unused", 2, 1, False, True, True, "fp32"),
    ("bf16", "param-groups", 1, 3, False, True, True, "fp32"),
    ("bf16-nocheck", "plain", 1, 3, False, False, True, None),
    ("bf16-nocheck", "sometimes-unused", 2, 1, True, True, False, None),
    ("bf16-nocheck", "param-groups", 2, 3, True, False, False, "fp32"),
    ("fp32", "plain", 2, 3, True, True, True, None),
    ("fp32", "sometimes-unused", 1, 3, True, False, False, None),
    ("fp32", "param-groups", 1, 1, False, False, False, "fp32"),
    ("fp16", "plain", 1, 1, False, False, False, "fp32"),
    ("fp16", "sometimes-unused", 1, 1, False, False, False, None),
    ("fp16", "param-groups", 2, 3, True, True, True, None),
)


def _faults(precision: str, grad_accum: int) -> tuple:
    if not bad_gradients_survive(precision):
        return ()  # DeepSpeed 0.14.0 - 0.17.0 fail in step() on a bad gradient in bf16 and fp32, patched or not
    if precision == "bf16-nocheck":
        return (Fault(STEPS - 1, "nan", rank=0, param=2), )
    return (Fault(1, "inf", rank=0, param=3), Fault(3, "nan", rank=1, param=6, micro=0 if grad_accum > 1 else None))


def _run(row) -> Run:
    values = dict(zip(FACTORS, row))
    name = "-".join(f"{SHORT.get(k, k[:4])}={v}" for k, v in values.items())
    return Run(name, steps=STEPS, faults=_faults(values["precision"], values["grad_accum"]), **values)


PAIRWISE = tuple(_run(row) for row in _ROWS)
ZENFLOW = Run("zenflow-bf16-s2", stage=2, zenflow=True, steps=STEPS, faults=(Fault(STEPS - 1, "inf", rank=0), ))
# ZenFlow exists from DeepSpeed 0.17.6: on older releases there is no such configuration to compare.
RUNS = PAIRWISE + ((ZENFLOW, ) if zenflow_available() else ())


def _ignores_overflow(self, grad_or_param):
    """A deliberately broken tracker: never records an overflow."""


def install_broken_tracker() -> None:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed_offload_patch.changes import UPSTREAM
    setattr(DeepSpeedZeroOptimizer, UPSTREAM.form_for(DeepSpeedZeroOptimizer).tracker, _ignores_overflow)


@pytest.fixture(scope="module")
def sides():
    """Every run, trained in patched processes and in unpatched ones; the runs whose reference is unpatched
    DeepSpeed with its compact buffer off, in such processes too."""
    found = {side: run_side(side, RUNS) for side in (PATCHED, UNPATCHED)}
    for side in (BUFFER_OFF, CLEARED_AFTER_SKIP, TRAINING_FIXED):
        runs = [run for run in RUNS if reference_side(run) == side]
        if runs:
            found[side] = run_side(side, runs)
    return found


def test_the_runs_cover_every_pair():
    for (a, values_a), (b, values_b) in itertools.combinations(FACTORS.items(), 2):
        seen = {(getattr(run, a), getattr(run, b)) for run in PAIRWISE}
        missing = set(itertools.product(values_a, values_b)) - seen
        assert not missing, f"no run has {a}, {b} = {sorted(missing, key=str)}"


def test_each_side_runs_the_code_it_claims(sides):
    for rank in sides[PATCHED]:
        assert rank["state"] in GOOD_STATES, rank["state"]
    for rank in sides[UNPATCHED]:
        assert rank["state"] == "disabled", rank["state"]
        assert set(rank["methods"].values()) == {"deepspeed.runtime.zero.stage_1_and_2"}, rank["methods"]
    if sides[PATCHED][0]["state"] == "applied":
        assert set(sides[PATCHED][0]["methods"].values()) == {"deepspeed_offload_patch.changes.overflow_flag.methods"}


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_patched_and_unpatched_train_the_same_bits(sides, run):
    found = differences(sides[PATCHED], sides[reference_side(run)], run.name)
    assert not found, "\n".join(found[:10])
    if reference_side(run) in (BUFFER_OFF, CLEARED_AFTER_SKIP):
        # Not a vacuous reference: unpatched DeepSpeed, with its buffer, skips steps the reference takes.
        assert any("skipped" in line for line in differences(sides[UNPATCHED], sides[reference_side(run)], run.name))
    if reference_side(run) == TRAINING_FIXED:
        # Where the release drops micro-batches or applies an unchecked bad step, the fix is what the reference has
        # beside unpatched DeepSpeed.
        assert bool(differences(sides[UNPATCHED], sides[TRAINING_FIXED], run.name)) == bool(training_fixes(run))


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_patched_boundary_backward_makes_no_host_sync(sides, run):
    """0 host syncs in every patched boundary backward, every rank, every step; unpatched DeepSpeed makes them
    (its tracker reads the host, whether or not anything reads the flag)."""
    patched, unpatched = boundary_syncs(sides[PATCHED], run.name), boundary_syncs(sides[UNPATCHED], run.name)
    assert all(count == 0 for rank in patched for count in rank), patched
    assert all(count > 0 for rank in unpatched for count in rank), unpatched


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_the_faults_did_what_they_should(sides, run):
    """Not a vacuous comparison: runs that skip bad steps skipped exactly their faulty steps, the others trained
    through them and their parameters hold the NaN."""
    problems = fault_problems(run, sides[PATCHED])
    assert not problems, "\n".join(problems)


def test_a_tracker_that_ignores_overflow_is_caught(sides):
    """The comparison can fail: a patch whose tracker ignores overflow differs from unpatched DeepSpeed.

    The first run whose flag ``step()`` reads (bf16 from 0.17.1, fp16 on every release) shows it in the flag before
    ``step()``. Before 0.19.8 the step then trains on the bad gradient (skip counts and parameters differ too); 0.19.8
    also treats an invalid gradient norm as overflow, which still skips the step when the tracker misses it.
    """
    run = next(run for run in PAIRWISE if run.skips_bad_steps and run.precision != "fp32")
    try:
        broken = run_side(PATCHED, [run], setup=install_broken_tracker)
    except DistributedFailure as failure:
        # DeepSpeed 0.14.0 - 0.17.0: step() then takes the bad gradient and fails on its norm (the integer -1),
        # where the unpatched run skipped the step.
        assert per_param_tracker() and "vector_norm" in str(failure), failure
        return
    assert set(broken[0]["methods"].values()) >= {__name__}, broken[0]["methods"]
    found = differences(broken, sides[UNPATCHED], run.name)
    assert any(": flag False != True" in line for line in found), found
    if not invalid_norm_skips_step():
        assert any("skipped" in line for line in found), found
        assert any("parameters differ" in line for line in found), found
