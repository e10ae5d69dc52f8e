# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The invalid-norm fix: an offloaded ZeRO-1/2 step that no overflow check looked at (fp32; bf16 before 0.17.1) and
whose gradient holds an inf/NaN is skipped, the way DeepSpeed skips an overflowed step, instead of crashing
``step()`` (0.14.0 - 0.17.0) or turning the fp32 master weights into NaN (0.17.1 - 0.19.7); a step without one is
computed bit for bit as before.

On 2 ranks, each cell of :mod:`deepspeed_offload_patch.testing.outcomes` (ZeRO-1 or 2 with ``offload_optimizer``, 4
steps, the fault in step 1) is trained with the fault and as this process's switches say (the red/green run disables
the package), and compared with :mod:`deepspeed_offload_patch.testing.skips`' reference at every step: parameters,
fp32 master partitions, optimizer state, loss scale, step counts and gradient norm. Where the release has the defect
the reference is the same job without the fault, the fix off, the faulty step skipped by DeepSpeed's own overflow
path; where DeepSpeed skips such a step itself (0.19.8) it is unpatched DeepSpeed with the same fault. Cells that
DeepSpeed checks itself (fp16; bf16 with the check on from 0.17.1) are held to the same forced reference, which must
then equal DeepSpeed's own skip.

bf16 with ``check_grad_overflow: false`` is the user's opt-out: from 0.17.1 the fix leaves it as DeepSpeed 0.19.8
does (the step is applied); ZeRO-1 bf16 on 0.17.x, whose ranks disagree, is another change's.
"""

import pytest

from deepspeed_offload_patch.changes import by_name
from deepspeed_offload_patch.settings import DISABLE
from deepspeed_offload_patch.testing import skips
from deepspeed_offload_patch.testing.installed import has_defect, per_param_tracker
from deepspeed_offload_patch.testing.launch import run_distributed
from deepspeed_offload_patch.testing.outcomes import Cell
from unit.common import assert_ok, run_python

WORLD = 2
INVALID_NORM = by_name("invalid-norm")
DEFECT = has_defect(INVALID_NORM.name)
#: bf16 has no overflow check before 0.17.1: there its steps are the fix's too.
BF16_UNCHECKED = per_param_tracker()
#: fp32 at both stages, accumulation 1 and 2, an inf on rank 0 and a NaN on every rank; bf16 with the check on; fp16.
FAULTY = (
    Cell(stage=2, precision="fp32", grad_accum=1),
    Cell(stage=1, precision="fp32", grad_accum=2, fault="nan", every_rank=True),
    Cell(stage=2, precision="fp32", grad_accum=2),
    Cell(stage=2, precision="bf16", grad_accum=2),
    Cell(stage=2, precision="fp16", grad_accum=1),
)
CLEAN = (Cell(stage=2, precision="fp32", grad_accum=2), Cell(stage=1, precision="fp32"))
#: The opt-out, with the fault: from 0.17.1 the fix leaves it alone (bf16 before 0.17.1 has no such option).
OPT_OUT = Cell(stage=2, precision="bf16-off", grad_accum=1)


def _fixed_here(cell: Cell) -> bool:
    """Whether the fix is what skips ``cell``'s faulty step on this release: no check looks at it."""
    return DEFECT and (cell.precision == "fp32" or (cell.precision.startswith("bf16") and BF16_UNCHECKED))


def _marks(cell: Cell) -> tuple:
    return (pytest.mark.fails_unpatched, ) if _fixed_here(cell) else ()


def _runs(reference: bool) -> list:
    """``reference``: the expected side (forced overflow, no fault) where the fix or DeepSpeed's check skips the step
    on this release, and unpatched DeepSpeed with the fault where DeepSpeed skips it by its norm (0.19.8)."""
    faulty = [(cell.name, cell, reference and (DEFECT or cell.precision in ("fp16", "bf16")), True) for cell in FAULTY]
    clean = [(f"{cell.name}-clean", cell, False, False) for cell in CLEAN]
    return faulty + clean + [(OPT_OUT.name, OPT_OUT, reference and DEFECT and BF16_UNCHECKED, True)]


@pytest.fixture(scope="module")
def trained() -> dict:
    """The cells as this process's switches say, and the references (see the module's doc)."""
    found = skips.train_each(_runs(reference=False), WORLD)
    env = {INVALID_NORM.switch: "0"} if DEFECT else {DISABLE: "1"}
    return {"found": found, "expected": skips.train_each(_runs(reference=True), WORLD, env)}


@pytest.mark.parametrize("cell", [pytest.param(cell, marks=_marks(cell), id=cell.name) for cell in FAULTY])
def test_the_faulty_step_is_skipped(trained, cell):
    """Nothing of the faulty step reaches the parameters, master weights or optimizer state; the step is counted as
    skipped; every later step trains, all finite."""
    for rank in range(WORLD):
        assert skips.skip_problems(trained["found"][rank][cell.name]) == [], rank


@pytest.mark.parametrize("cell", [pytest.param(cell, marks=_marks(cell), id=cell.name) for cell in FAULTY])
def test_the_skip_is_deepspeeds_own_bit_for_bit(trained, cell):
    for rank in range(WORLD):
        assert skips.differences(trained["found"][rank][cell.name], trained["expected"][rank][cell.name]) == [], rank


@pytest.mark.parametrize("cell", CLEAN, ids=lambda cell: cell.name)
def test_without_a_fault_every_bit_is_as_without_the_fix(trained, cell):
    for rank in range(WORLD):
        key = f"{cell.name}-clean"
        assert skips.differences(trained["found"][rank][key], trained["expected"][rank][key]) == [], rank


@pytest.mark.parametrize("cell", [pytest.param(OPT_OUT, marks=_marks(OPT_OUT), id=OPT_OUT.name)])
def test_bf16_with_the_check_turned_off_is_left_as_deepspeed_0_19_8_leaves_it(trained, cell):
    """From 0.17.1, ``check_grad_overflow: false`` is the user's choice: the faulty step is applied with the fix as
    without it, bit for bit (0.19.8 applies it too). Before 0.17.1 bf16 has no such option, and the step is skipped."""
    for rank in range(WORLD):
        assert skips.differences(trained["found"][rank][cell.name], trained["expected"][rank][cell.name]) == [], rank
    if BF16_UNCHECKED:
        assert skips.skip_problems(trained["found"][0][cell.name]) == []
    else:
        assert skips.skip_problems(trained["found"][0][cell.name]) != []


def test_the_reference_skips_and_the_fault_without_the_fix_does_not(trained):
    """The reference is itself a skip; and where the release has the defect, what the fixed cells are held to can
    fail: the fault with the fix switched off crashes or differs from it."""
    for cell in FAULTY:
        assert skips.skip_problems(trained["expected"][0][cell.name]) == [], cell.name
    if DEFECT:
        cell = FAULTY[0]
        unfixed = skips.train_each([(cell.name, cell, False, True)], WORLD, {INVALID_NORM.switch: "0"})[0][cell.name]
        if BF16_UNCHECKED:  # 0.14.0 - 0.17.0: the integer -1 crashes step()
            assert isinstance(unfixed, str) and "Long" in unfixed, unfixed
        else:
            assert skips.skip_problems(unfixed) != []
            assert skips.differences(unfixed, trained["expected"][0][cell.name]) != []


@pytest.mark.fails_unpatched
def test_the_fix_is_in_place_where_the_release_has_the_defect(trained):
    expected = "applied" if DEFECT else "not-needed"
    assert trained["found"][0]["status"][INVALID_NORM.name] == expected
    assert trained["expected"][0]["status"][INVALID_NORM.name] in ("off", "disabled")


@pytest.mark.fails_unpatched  # unpatched, step() reads one gradient norm per tensor (the on-device grad norm's defect)
def test_the_check_adds_at_most_one_host_read_per_step_at_any_size():
    """The fix reads the host once per step (whether a group norm was invalid), whatever the number of parameter
    tensors, and computes the norm once: the step's host syncs are the same at 8 and 32 tensors and at most one more
    than without the fix, and the backward's are unchanged."""
    sizes = (8, 32)
    found = run_distributed(skips.step_syncs_by_size, WORLD, args=(CLEAN, sizes), fork_server=True)[0]
    # The other changes stay as they are: they move the counts too (the sync fix takes the backward's).
    without = run_distributed(skips.step_syncs_by_size,
                              WORLD,
                              args=(CLEAN, sizes),
                              env={INVALID_NORM.switch: "0"},
                              fork_server=True)[0]
    assert skips.added_read_problems(found, without, CLEAN, sizes) == [], (found, without)


def test_apply_is_idempotent_and_revert_puts_deepspeeds_methods_back():
    """On the installed release, in a fresh interpreter with the default switches: where the fix applies, the class
    holds the package's two replacements; a second ``apply()`` changes nothing; ``revert()`` puts DeepSpeed's own
    function objects back, and ``apply()`` installs the replacements again. Where the release does not need it,
    nothing on the class changes."""
    assert_ok(
        run_python(f"""
        import deepspeed_offload_patch as dop
        from deepspeed_offload_patch.changes import by_name
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as cls
        change = by_name("invalid-norm")
        names = ("scaled_global_norm", "_update_scale")
        ours = {{name: [function for _, function in change.replacements(name)] for name in names}}
        installed = {{name: cls.__dict__[name] for name in names}}
        state = dop.status().of(change)[0]
        if {DEFECT}:
            assert state == "applied", dop.status()
            assert all(installed[name] in ours[name] for name in names)
            originals = {{name: dop.patcher.originals()[name] for name in names}}
            dop.apply()
            assert all(cls.__dict__[name] is installed[name] for name in names)
            assert dop.revert().of(change)[0] == "reverted"
            assert all(cls.__dict__[name] is originals[name] for name in names)
            assert dop.apply().of(change)[0] == "applied"
            assert all(cls.__dict__[name] in ours[name] for name in names)
        else:
            assert state == "not-needed", dop.status()
            dop.revert()
            assert all(cls.__dict__[name] is installed[name] for name in names)
    """))
