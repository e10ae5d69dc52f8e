# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The ZeRO-3 overflow fix: an offloaded bf16 or fp32 ZeRO-3 step with an inf/NaN gradient is skipped, the way
DeepSpeed skips an overflowed step, and a step without one is computed bit for bit as before.

On 2 ranks, each cell of :mod:`deepspeed_offload_patch.testing.outcomes` (ZeRO-3 with ``offload_optimizer``, 4 steps,
the fault in step 1) is trained with the fault and as this process's switches say (the red/green run disables the
package), and compared with :mod:`deepspeed_offload_patch.testing.skips`' reference, at every step: parameters, fp32
master partitions, optimizer state, loss scale, step counts and gradient norm.

* Where the release has the defect (0.14.0 - 0.19.7) the reference is the same job without the fault, with the fix
  switched off and the faulty step skipped by DeepSpeed's own overflow path; unpatched, the fault reaches the weights
  and these cells fail.
* Where DeepSpeed skips such a step itself (0.19.8) the reference is unpatched DeepSpeed with the same fault: the
  package changes no bit.
* fp16, which DeepSpeed checks on every release: the reference is built the same forced way, and must equal
  DeepSpeed's own skip of the real fault bit for bit (loss scale included): the reference means what DeepSpeed
  means by a skipped step.

Without a fault, the fix on and the fix off train the same bits (the check it adds only reads).
"""

import pytest

from deepspeed_offload_patch.changes import by_name
from deepspeed_offload_patch.settings import DISABLE
from deepspeed_offload_patch.testing import skips
from deepspeed_offload_patch.testing.installed import has_defect
from deepspeed_offload_patch.testing.launch import run_distributed
from deepspeed_offload_patch.testing.outcomes import Cell
from unit.common import assert_ok, run_python

WORLD = 2
ZERO3_OVERFLOW = by_name("zero3-overflow")
METHOD = "_overflow_check_and_loss_scale_update"
DEFECT = has_defect(ZERO3_OVERFLOW.name)
#: bf16 with the check on, left out and off (ZeRO-3 reads none of them), fp32; accumulation 1 and 2; with and without
#: offload_param; an inf on rank 0, and a NaN on every rank.
FAULTY = (
    Cell(stage=3, precision="bf16", grad_accum=1),
    Cell(stage=3, precision="bf16-unset", grad_accum=2, offload_param=True),
    Cell(stage=3, precision="bf16-off", grad_accum=1),
    Cell(stage=3, precision="fp32", grad_accum=2),
    Cell(stage=3, precision="fp32", grad_accum=1, offload_param=True, fault="nan", every_rank=True),
    # Where DeepSpeed checks every step itself: its own skip of the fault, which the reference must be too.
    Cell(stage=3, precision="fp16", grad_accum=2),
)
CLEAN = (Cell(stage=3, precision="bf16", grad_accum=2), Cell(stage=3, precision="fp32", offload_param=True))


def _fails_unpatched(cell: Cell) -> tuple:
    """fp16 skips by DeepSpeed's own check on every release; the others fail unpatched where the release has the
    defect."""
    return (pytest.mark.fails_unpatched, ) if DEFECT and cell.precision != "fp16" else ()


def _runs(reference: bool) -> list:
    """``reference``: the expected side, where the faulty cells are the reference (forced overflow, no fault) where
    the release has the defect, and always in fp16 (DeepSpeed's own skip checks it there); else the faulty cells
    themselves."""
    faulty = [(cell.name, cell, reference and (DEFECT or cell.precision == "fp16"), True) for cell in FAULTY]
    return faulty + [(f"{cell.name}-clean", cell, False, False) for cell in CLEAN]


@pytest.fixture(scope="module")
def trained() -> dict:
    """The cells as this process's switches say, and the references (see the module's doc)."""
    found = run_distributed(skips.train_many, WORLD, args=(_runs(reference=False), ), fork_server=True)
    env = {ZERO3_OVERFLOW.switch: "0"} if DEFECT else {DISABLE: "1"}
    expected = run_distributed(skips.train_many, WORLD, args=(_runs(reference=True), ), env=env, fork_server=True)
    return {"found": found, "expected": expected}


@pytest.mark.parametrize("cell", [pytest.param(cell, marks=_fails_unpatched(cell), id=cell.name) for cell in FAULTY])
def test_the_faulty_step_is_skipped(trained, cell):
    """Nothing of the faulty step reaches the parameters, master weights or optimizer state; the step is counted as
    skipped; every later step trains, all finite."""
    for rank in range(WORLD):
        assert skips.skip_problems(trained["found"][rank][cell.name]) == [], rank


@pytest.mark.parametrize("cell", [pytest.param(cell, marks=_fails_unpatched(cell), id=cell.name) for cell in FAULTY])
def test_the_skip_is_deepspeeds_own_bit_for_bit(trained, cell):
    for rank in range(WORLD):
        assert skips.differences(trained["found"][rank][cell.name], trained["expected"][rank][cell.name]) == [], rank


@pytest.mark.parametrize("cell", CLEAN, ids=lambda cell: cell.name)
def test_without_a_fault_every_bit_is_as_without_the_fix(trained, cell):
    for rank in range(WORLD):
        key = f"{cell.name}-clean"
        assert skips.differences(trained["found"][rank][key], trained["expected"][rank][key]) == [], rank


def test_the_reference_skips_and_the_fault_without_the_fix_does_not(trained):
    """The reference is itself a skip (DeepSpeed's overflow path, or 0.19.8's own skip); and where the release has
    the defect, what the fixed cells are held to can fail: the fault with the fix switched off differs from it."""
    for cell in FAULTY:
        assert skips.skip_problems(trained["expected"][0][cell.name]) == [], cell.name
    if DEFECT:
        cell = FAULTY[0]
        unfixed = run_distributed(skips.train_many,
                                  WORLD,
                                  args=([(cell.name, cell, False, True)], ),
                                  env={ZERO3_OVERFLOW.switch: "0"},
                                  fork_server=True)
        assert skips.skip_problems(unfixed[0][cell.name]) != []
        assert skips.differences(unfixed[0][cell.name], trained["expected"][0][cell.name]) != []


@pytest.mark.fails_unpatched
def test_the_fix_is_in_place_where_the_release_has_the_defect(trained):
    expected = "applied" if DEFECT else "not-needed"
    assert trained["found"][0]["status"][ZERO3_OVERFLOW.name] == expected
    assert trained["expected"][0]["status"][ZERO3_OVERFLOW.name] in ("off", "disabled")


def test_the_check_adds_at_most_one_host_read_per_step_at_any_size():
    """The check the fix runs reads the host once per step, after its all-reduce, whatever the number of parameter
    tensors: the step's host syncs are the same at 8 and 32 tensors and at most one more than without the fix, and the
    backward's are unchanged (measured on 0.16.9: 2 -> 3 per step at both sizes). DeepSpeed's own backward can grow
    with the tensors (0.19.8 with offload_param: 45 at 8, 165 at 32): the fix's is unchanged."""
    cells, sizes = (CLEAN[0], CLEAN[1]), (8, 32)
    found = run_distributed(skips.step_syncs_by_size, WORLD, args=(cells, sizes), fork_server=True)[0]
    env = {ZERO3_OVERFLOW.switch: "0"} if DEFECT else {DISABLE: "1"}
    without = run_distributed(skips.step_syncs_by_size, WORLD, args=(cells, sizes), env=env, fork_server=True)[0]
    assert skips.added_read_problems(found, without, cells, sizes) == [], (found, without)


def test_apply_is_idempotent_and_revert_puts_deepspeeds_method_back():
    """On the installed release, in a fresh interpreter with the default switches (whatever this process's say): where the fix applies, ZeRO-3's class holds the package's
    replacement (under DeepSpeed's NVTX wrapper, as DeepSpeed's own method is); a second ``apply()`` changes nothing;
    ``revert()`` puts DeepSpeed's own function object back, and ``apply()`` installs the replacement again. Where the
    release does not need it, nothing on the class changes."""
    assert_ok(
        run_python(f"""
        import deepspeed_offload_patch as dop
        from deepspeed_offload_patch.guard import unwrapped
        from deepspeed_offload_patch.changes import by_name
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as cls
        name, change = "{METHOD}", by_name("zero3-overflow")
        ours = [function for _, function in change.replacements(name)]
        installed = cls.__dict__[name]
        state = dop.status().of(change)[0]
        if {DEFECT}:
            assert state == "applied", dop.status()
            assert unwrapped(installed) in ours and installed is not unwrapped(installed)
            original = dop.patcher.originals()["DeepSpeedZeroOptimizer_Stage3." + name]
            assert unwrapped(original) not in ours
            dop.apply()
            assert cls.__dict__[name] is installed and dop.status().of(change)[0] == "applied"
            assert dop.revert().of(change)[0] == "reverted" and cls.__dict__[name] is original
            assert dop.apply().of(change)[0] == "applied" and unwrapped(cls.__dict__[name]) in ours
        else:
            assert state == "not-needed", dop.status()
            assert unwrapped(installed) not in ours
            dop.revert()
            assert cls.__dict__[name] is installed
    """))
