# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Offload learns what the same job learns without it: DeepSpeed with ``offload_optimizer`` against plain PyTorch.

Each cell of :mod:`deepspeed_offload_patch.testing.oracle` trains 4 steps on 2 ranks through DeepSpeed (as this
process's switches say: the red/green run disables the package) and is compared with the same job computed in plain
PyTorch: every parameter after the steps and the global gradient norm of every step, fp32 to 1e-6, bf16 to the
oracle's stated tolerance. Where DeepSpeed drops gradients the cells that reach the defect are marked
``fails_unpatched``:

* the gradient-accumulation fix: ZeRO-2 with ``gradient_accumulation_steps`` 3 or 4 (DeepSpeed 0.15.2 - 0.18.x trains
  on the first and last micro-batch of each step);
* the several-backwards fix: ZeRO-2 with ``gradient_accumulation_steps`` 1 and 2 or 4 backwards per step through
  ``set_gradient_accumulation_boundary`` (up to 0.18.x only the last counts).

Where DeepSpeed is right (0.19.x, and the other cells everywhere) every cell must be right patched and unpatched. The
oracle can fail: a rank that drops micro-step 1 is caught; each fix switched off by its switch leaves its cells wrong
where the release has the defect, and the other fix still works.
"""

from typing import Dict

import pytest

from deepspeed_offload_patch.changes import by_name
from deepspeed_offload_patch.settings import DISABLE, UPSTREAM_ONLY
from deepspeed_offload_patch.states import State
from deepspeed_offload_patch.testing import oracle
from deepspeed_offload_patch.testing.installed import has_defect
from deepspeed_offload_patch.testing.launch import run_distributed

Cell = oracle.Cell
WORLD = 2
CELLS = (
    Cell(stage=2, grad_accum=1, clipping=True),
    Cell(stage=2, grad_accum=2),
    Cell(stage=2, grad_accum=3, clipping=True),
    Cell(stage=2, grad_accum=4),
    Cell(stage=2, grad_accum=4, precision="bf16"),
    Cell(stage=2, backwards=2, clipping=True),
    Cell(stage=2, backwards=4),
    Cell(stage=1, grad_accum=4, clipping=True),
    Cell(stage=1, backwards=4),
    # ZeRO-3, whose steps without an inf/NaN the package does not change: right on every release once each parameter
    # all-gather is waited for (testing/zero3_gather.py, which train_cells puts in place before 0.19.8: gloo's handles
    # are independent and those releases wait for the last alone, so a cell could come out right in one run and
    # wrong in the next).
    Cell(stage=3, grad_accum=3),
    Cell(stage=3, offload_param=True, backwards=4, clipping=True),
)
GRAD_ACCUMULATION, SEVERAL_BACKWARDS = by_name("grad-accumulation"), by_name("several-backwards")


def defective(change) -> bool:
    """Unpatched DeepSpeed here has the defect ``change`` fixes."""
    return has_defect(change.name)


def reaches(cell: Cell) -> list:
    """The changes whose defect ``cell`` reaches (ZeRO-2 only: ZeRO-1 reduces once, at the boundary)."""
    if cell.stage != 2:
        return []
    found = [GRAD_ACCUMULATION] if cell.micro_batches >= 3 else []
    return found + ([SEVERAL_BACKWARDS] if cell.backwards > 1 else [])


def _marks(cell: Cell) -> tuple:
    return (pytest.mark.fails_unpatched, ) if any(defective(change) for change in reaches(cell)) else ()


def _train(cells, env: Dict[str, str], setup=None) -> dict:
    return run_distributed(oracle.train_cells, WORLD, args=(tuple(cells), setup), env=env, fork_server=True)


def _right(cell: Cell, ranks: list) -> list:
    expected = oracle.reference(cell, WORLD)
    return [problem for rank in ranks for problem in oracle.compare(cell, rank[cell.name], expected)]


@pytest.fixture(scope="module")
def trained():
    """Every cell, as this process's switches say."""
    return _train(CELLS, {})


@pytest.mark.parametrize("cell", [pytest.param(cell, id=cell.name, marks=_marks(cell)) for cell in CELLS])
def test_offload_learns_what_plain_pytorch_learns(trained, cell):
    problems = _right(cell, trained)
    assert not problems, "\n".join(problems[:6])


def _drop_micro_step_one() -> None:
    """A deliberately broken accumulation: micro-step 1's gradient is zeroed before it is accumulated."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu

    def dropping(self, param):
        if self.micro_step_id == 1:
            self.get_param_gradient_attribute(param).zero_()
        return original(self, param)

    DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu = dropping


def test_the_oracle_catches_a_dropped_micro_batch():
    """Not a vacuous comparison: the same job with micro-step 1 dropped is wrong, in the norm and the parameters."""
    cell = Cell(stage=2, grad_accum=3)
    problems = _right(cell, _train([cell], {}, setup=_drop_micro_step_one))
    assert any("gradient norm" in problem for problem in problems), problems
    assert any("parameters off" in problem for problem in problems), problems


@pytest.mark.parametrize("switch", [GRAD_ACCUMULATION.switch, SEVERAL_BACKWARDS.switch, UPSTREAM_ONLY])
def test_each_fix_is_its_own_switch(switch):
    """With one fix's switch at 0 (or only the upstream change on), that fix's cells train as DeepSpeed does here
    (wrong where it has the defect) and the other fix's cells stay right; the states say so."""
    off = {GRAD_ACCUMULATION, SEVERAL_BACKWARDS} if switch == UPSTREAM_ONLY else {
        change
        for change in (GRAD_ACCUMULATION, SEVERAL_BACKWARDS) if change.switch == switch
    }
    cells = [Cell(stage=2, grad_accum=3), Cell(stage=2, backwards=2)]
    ranks = _train(cells, {switch: "1" if switch == UPSTREAM_ONLY else "0", DISABLE: "0"})
    for change in (GRAD_ACCUMULATION, SEVERAL_BACKWARDS):
        state = ranks[0]["status"][change.name]
        if change in off:
            assert state == State.OFF, (change.name, state)
        else:
            assert state in (State.APPLIED, State.NOT_NEEDED), (change.name, state)
    for cell in cells:
        # A cell stays wrong only where a fix it needs is off and the release has that fix's defect.
        broken = [change for change in reaches(cell) if change in off and defective(change)]
        # Several backwards through the CPU buffer also need the accumulation fix from 3 backwards on: 2 do not.
        problems = _right(cell, ranks)
        assert bool(problems) == bool(broken), (cell.name, [c.name for c in broken], problems[:3])


def _force_gather_wait() -> None:
    from deepspeed_offload_patch.testing import zero3_gather

    zero3_gather.wait_every_gather(force=True)


def test_zero3_cells_wait_for_every_gather():
    """The condition the ZeRO-3 cells run under is in place: before 0.19.8 train_cells waits for every all-gather
    handle ZeRO-3's coalesced gather starts (it fails where DeepSpeed moved the gather, and the wrapper would wait for
    nothing), and a ZeRO-3 job trained with it is right."""
    from deepspeed_offload_patch.testing import zero3_gather

    cell = Cell(stage=3, grad_accum=2)
    ranks = _train([cell], {}, setup=_force_gather_wait)
    assert all(rank["zero3_gathers_waited"] > 0 for rank in ranks), [rank["zero3_gathers_waited"] for rank in ranks]
    assert not _right(cell, ranks)
    assert ranks[0]["zero3_gather_wait"] is True
    assert _train([cell], {})[0]["zero3_gather_wait"] is zero3_gather.needed()
