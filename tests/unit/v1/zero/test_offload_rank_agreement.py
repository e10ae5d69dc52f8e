# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The rank-agreement fix: with ``offload_optimizer``, ZeRO-1's ranks agree about an overflow, so an inf on one rank
makes every rank skip the step (DeepSpeed 0.17.1 - 0.17.6 let that rank skip while the other steps, and the next
collective fails); a step without one is computed bit for bit as before.

On 2 ranks, ZeRO-1 cells of :mod:`deepspeed_offload_patch.testing.outcomes` in the precisions whose steps are checked
(fp16, bf16 with the check on), the fault on rank 0 only, are trained as this process's switches say (the red/green
run disables the package) and compared at every step with :mod:`deepspeed_offload_patch.testing.skips`' reference:
the same job without the fault, the faulty step skipped on every rank by DeepSpeed's own overflow path, the fix off.
Where the release has no such defect the reference is the same job with the same fault and the fix off.
"""

import pytest

from deepspeed_offload_patch.changes import by_name
from deepspeed_offload_patch.testing import skips
from deepspeed_offload_patch.testing.installed import has_defect, per_param_tracker
from deepspeed_offload_patch.testing.outcomes import Cell
from unit.common import assert_ok, fails_unpatched_if, run_python

WORLD = 2
RANK_AGREEMENT = by_name("rank-agreement")
DEFECT = has_defect(RANK_AGREEMENT.name)
FAULTY = (Cell(stage=1, precision="bf16", grad_accum=1), Cell(stage=1, precision="fp16", grad_accum=2))
CLEAN = (Cell(stage=1, precision="bf16", grad_accum=2), )
#: Before 0.17.1 unpatched DeepSpeed crashes on a bf16 inf (the invalid-norm fix's defect): its cells fail unpatched.
BF16_CRASHES = per_param_tracker() and has_defect("invalid-norm")


def _marks(cell: Cell) -> tuple:
    crashes = BF16_CRASHES and cell.precision == "bf16"
    return (pytest.mark.fails_unpatched, ) if DEFECT or crashes else ()


def _runs(reference: bool) -> list:
    faulty = [(cell.name, cell, reference, True) for cell in FAULTY]
    return faulty + [(f"{cell.name}-clean", cell, False, False) for cell in CLEAN]


@pytest.fixture(scope="module")
def trained() -> dict:
    found = skips.train_each(_runs(reference=False), WORLD)
    # The fix off, the other changes as they are (before 0.17.1 the invalid-norm fix is what skips a bf16 step).
    return {"found": found, "expected": skips.train_each(_runs(reference=DEFECT), WORLD, {RANK_AGREEMENT.switch: "0"})}


@pytest.mark.parametrize("cell", [pytest.param(cell, marks=_marks(cell), id=cell.name) for cell in FAULTY])
def test_every_rank_skips_the_faulty_step_bit_for_bit(trained, cell):
    for rank in range(WORLD):
        found = trained["found"][rank][cell.name]
        assert skips.skip_problems(found) == [], rank
        assert skips.differences(found, trained["expected"][rank][cell.name]) == [], rank


@pytest.mark.parametrize("cell", CLEAN, ids=lambda cell: cell.name)
def test_without_a_fault_every_bit_is_as_without_the_fix(trained, cell):
    key = f"{cell.name}-clean"
    for rank in range(WORLD):
        assert skips.differences(trained["found"][rank][key], trained["expected"][rank][key]) == []


@fails_unpatched_if(BF16_CRASHES)  # before 0.17.1 the unpatched reference crashes on its bf16 inf
def test_the_reference_skips_and_the_fault_without_the_fix_parts_the_ranks(trained):
    """The reference is itself a skip on every rank; and where the release has the defect, what the fixed cells are
    held to can fail: the fault with the fix switched off does not give every rank the same skipped step."""
    for cell in FAULTY:
        for rank in range(WORLD):
            assert skips.skip_problems(trained["expected"][rank][cell.name]) == [], (cell.name, rank)
    if DEFECT:
        unfixed = skips.train_each([(FAULTY[0].name, FAULTY[0], False, True)], WORLD, {RANK_AGREEMENT.switch: "0"})
        results = [unfixed[rank][FAULTY[0].name] for rank in range(WORLD)]
        assert any(skips.skip_problems(result) != [] for result in results), results


@pytest.mark.fails_unpatched
def test_the_fix_is_in_place_where_the_release_has_the_defect(trained):
    expected = "applied" if DEFECT else "not-needed"
    assert trained["found"][0]["status"][RANK_AGREEMENT.name] == expected


def test_apply_is_idempotent_and_revert_puts_deepspeeds_method_back():
    assert_ok(
        run_python(f"""
        import deepspeed_offload_patch as dop
        from deepspeed_offload_patch.changes import by_name
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as cls
        change, name = by_name("rank-agreement"), "_check_overflow"
        ours = [function for _, function in change.replacements(name)]
        installed = cls.__dict__[name]
        state = dop.status().of(change)[0]
        if {DEFECT}:
            assert state == "applied" and installed in ours, dop.status()
            original = dop.patcher.originals()[name]
            dop.apply()
            assert cls.__dict__[name] is installed
            assert dop.revert().of(change)[0] == "reverted" and cls.__dict__[name] is original
            assert dop.apply().of(change)[0] == "applied" and cls.__dict__[name] in ours
        else:
            assert state == "not-needed" and installed not in ours, dop.status()
            dop.revert()
            assert cls.__dict__[name] is installed
    """))
