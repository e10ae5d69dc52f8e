# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The bf16-check default: a bf16 config that leaves ``check_grad_overflow`` out (as HF Trainer's and Accelerate's
do) gets DeepSpeed 0.19.3's default, so an offloaded ZeRO-1/2 step with an inf/NaN is skipped instead of applied
(0.17.1 - 0.19.2 default the check to false, and the master weights turn NaN); an explicit value is left alone.

On 2 ranks, cells of :mod:`deepspeed_offload_patch.testing.outcomes` with the key left out (``bf16-unset``) are
trained as this process's switches say (the red/green run disables the package) and compared at every step with the
same job whose config sets the key to true, trained with this change switched off: DeepSpeed's own check, bit for
bit, the skip included. Without a fault, and with the key set to false, the change alters nothing: every bit is as
with it switched off.
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
BF16_CHECK = by_name("bf16-check")
DEFECT = has_defect(BF16_CHECK.name)
#: The key left out: ZeRO-2 with an inf on rank 0, ZeRO-1 accumulating over 2 micro-steps with a NaN on every rank.
FAULTY = (Cell(stage=2, precision="bf16-unset"),
          Cell(stage=1, precision="bf16-unset", grad_accum=2, fault="nan", every_rank=True))
CLEAN = (Cell(stage=2, precision="bf16-unset", grad_accum=2), )
#: The user's opt-out, with the fault: left as DeepSpeed leaves it.
OPT_OUT = Cell(stage=2, precision="bf16-off")
MARKS = (pytest.mark.fails_unpatched, ) if DEFECT else ()
#: The package as its defaults have it, this change left out: the references, whatever this process's switches say
#: (ZeRO-1's ranks agree about an overflow on 0.17.x only with the rank-agreement fix).
OFF = {DISABLE: "0", BF16_CHECK.switch: "0"}


def _checked(cell: Cell) -> Cell:
    return Cell(cell.stage, "bf16", cell.grad_accum, cell.fault, cell.every_rank, cell.offload_param)


@pytest.fixture(scope="module")
def trained() -> dict:
    """The cells as this process's switches say; the references with the change off: the faulty cells with the key
    set to true, the clean and opted-out cells as they are."""
    runs = [(cell.name, cell, False, True) for cell in FAULTY + (OPT_OUT, )]
    runs += [(f"{cell.name}-clean", cell, False, False) for cell in CLEAN]
    references = [(cell.name, _checked(cell), False, True) for cell in FAULTY] + [(OPT_OUT.name, OPT_OUT, False, True)]
    references += [(f"{cell.name}-clean", cell, False, False) for cell in CLEAN]
    return {"found": skips.train_each(runs, WORLD), "expected": skips.train_each(references, WORLD, OFF)}


@pytest.mark.parametrize("cell", [pytest.param(cell, marks=MARKS, id=cell.name) for cell in FAULTY])
def test_the_faulty_step_is_skipped(trained, cell):
    """Nothing of the faulty step reaches the parameters, master weights or optimizer state; it is counted as
    skipped; every later step trains, all finite."""
    for rank in range(WORLD):
        assert skips.skip_problems(trained["found"][rank][cell.name]) == [], rank


@pytest.mark.parametrize("cell", [pytest.param(cell, marks=MARKS, id=cell.name) for cell in FAULTY])
def test_the_key_left_out_trains_as_the_key_set_to_true(trained, cell):
    for rank in range(WORLD):
        assert skips.differences(trained["found"][rank][cell.name], trained["expected"][rank][cell.name]) == [], rank


@pytest.mark.parametrize("cell", CLEAN, ids=lambda cell: cell.name)
def test_without_a_fault_every_bit_is_as_without_the_change(trained, cell):
    key = f"{cell.name}-clean"
    for rank in range(WORLD):
        assert skips.differences(trained["found"][rank][key], trained["expected"][rank][key]) == [], rank


def test_an_explicit_false_is_left_alone(trained):
    """``check_grad_overflow: false`` is the user's opt-out: the faulty step is trained with the change as without
    it, bit for bit (from 0.17.1 ZeRO-2 applies it, as DeepSpeed 0.19.8 does)."""
    for rank in range(WORLD):
        found, expected = trained["found"][rank][OPT_OUT.name], trained["expected"][rank][OPT_OUT.name]
        assert skips.differences(found, expected) == [], rank


def test_the_reference_skips_and_the_key_left_out_without_the_change_does_not(trained):
    """What the cells are held to is DeepSpeed's own skip; and where the release has the defect, the reference can
    tell: the key left out with the change switched off applies the faulty step."""
    for cell in FAULTY:
        assert skips.skip_problems(trained["expected"][0][cell.name]) == [], cell.name
    if DEFECT:
        cell = FAULTY[0]
        unfixed = skips.train_each([(cell.name, cell, False, True)], WORLD, OFF)[0][cell.name]
        assert skips.skip_problems(unfixed) != []
        assert skips.differences(unfixed, trained["expected"][0][cell.name]) != []


@pytest.mark.fails_unpatched
def test_the_change_is_in_place_where_the_release_has_the_defect(trained):
    expected = "applied" if DEFECT else "not-needed"
    assert trained["found"][0]["status"][BF16_CHECK.name] == expected
    assert trained["expected"][0]["status"][BF16_CHECK.name] in ("off", "disabled")


@pytest.mark.fails_unpatched  # unpatched, step() reads one gradient norm per tensor (the on-device grad norm's defect)
def test_the_check_newly_on_adds_at_most_one_host_read_per_step_at_any_size():
    """Where the key left out now checks, the step reads the all-reduced flag once, whatever the number of tensors:
    its host syncs are the same at 8 and 32 tensors and at most one more than with the change off; the backward's
    are unchanged (the package's overflow flag stays on the device)."""
    sizes = (8, 32)
    found = run_distributed(skips.step_syncs_by_size, WORLD, args=(CLEAN, sizes), fork_server=True)[0]
    without = run_distributed(skips.step_syncs_by_size, WORLD, args=(CLEAN, sizes), env=OFF, fork_server=True)[0]
    assert skips.added_read_problems(found, without, CLEAN, sizes) == [], (found, without)


def test_verify_s_check_passes_with_the_change_and_can_fail_without_it():
    """``verify``'s ``check-left-out`` (a bf16 engine whose config leaves the key out, a NaN at its first step): it
    holds with the package's defaults; with the change off it fails where the release has the defect."""
    from deepspeed_offload_patch import verify

    found = run_distributed(verify._check_left_out, 1, args=("bf16", ), env={DISABLE: "0"}, fork_server=True)[0]
    assert all(found.values()), found
    without = run_distributed(verify._check_left_out, 1, args=("bf16", ), env=OFF, fork_server=True)[0]
    assert all(without.values()) != DEFECT, without


def test_on_the_installed_release_the_config_class_is_changed_only_where_needed():
    """In a fresh interpreter with the default switches: where the release defaults the check to false, a config
    without the key reads true and one with false keeps it; ``revert()`` puts DeepSpeed's own class attributes back
    (the same objects). Elsewhere the class is left as it is."""
    assert_ok(
        run_python(f"""
        import deepspeed_offload_patch as dop
        import deepspeed.runtime.config  # the config (and from 0.17.1 its bf16 section's module)
        from deepspeed_offload_patch.changes import by_name
        change = by_name("bf16-check")
        state = dop.status().of(change)[0]
        if {DEFECT}:
            from deepspeed.runtime.precision_config import DeepSpeedBF16Config as cls
            assert state == "applied", dop.status()
            assert cls(enabled=True).check_grad_overflow is True
            assert cls(enabled=True, check_grad_overflow=False).check_grad_overflow is False
            dop.revert()
            assert cls(enabled=True).check_grad_overflow is False
        else:
            assert state == "not-needed", dop.status()
    """))
