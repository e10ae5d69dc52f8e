# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""A skipped step is never silent (DeepSpeed issue 8415): one WARNING on rank 0 per optimizer step the engine skips
for an inf/NaN, with the step, why and the count so far; an ERROR from the third skipped step in a row; the count
also from ``deepspeed_offload_patch.skipped_steps()``; no line and no count with ``DS_OFFLOAD_PATCH_SKIP_LOG=0``; no
host read added; ``revert()`` puts the engine's own method back.

2 ranks, ZeRO-2 with ``offload_optimizer``, bf16 with the check on (every release skips such a step: the line is what
this tests), an inf on rank 0 in the steps a test names, 5 steps.
"""

import logging

import pytest
import torch

from deepspeed_offload_patch.settings import SKIP_LOG
from deepspeed_offload_patch.testing.installed import per_param_tracker
from deepspeed_offload_patch.testing.launch import run_distributed
from deepspeed_offload_patch.testing.outcomes import Cell
from unit.common import assert_ok, fails_unpatched_if, run_python

WORLD, STEPS = 2, 5
CELL = Cell(stage=2, precision="bf16")


class _Keep(logging.Handler):

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        if "[deepspeed_offload_patch] step" in record.getMessage():
            self.lines.append((record.levelname, record.getMessage()))


def _train(faults) -> dict:
    """Train :data:`CELL` for :data:`STEPS` steps on this rank with an inf on rank 0 in each step of ``faults``: the
    package's lines (level, message), its count, the engine's count, and the host syncs of each ``engine.step()``."""
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.utils import logger

    import deepspeed_offload_patch
    from deepspeed_offload_patch.hostsync import READ, count_host_syncs
    from deepspeed_offload_patch.testing import oracle, outcomes

    keep = _Keep()
    logger.addHandler(keep)
    rank = dist.get_rank()
    engine, _, _, _ = deepspeed.initialize(model=oracle.model(), config=CELL.config())
    armed = [False]
    next(iter(engine.module.parameters())).register_hook(outcomes._fault_hook(CELL, armed))
    syncs = []
    for step in range(STEPS):
        armed[0] = step in faults and rank == 0
        engine.backward(engine(oracle.inputs(step, 0, rank).to(engine.device, torch.bfloat16)))
        with count_host_syncs(kinds=(READ, )) as counted, torch.no_grad():
            engine.step()
        syncs.append(counted.total)
    logger.removeHandler(keep)
    return {
        "lines": keep.lines,
        "count": deepspeed_offload_patch.skipped_steps(),
        "engine": engine.skipped_steps,
        "syncs": syncs
    }


@pytest.mark.fails_unpatched
def test_one_warning_per_skipped_step_on_rank_0_with_the_step_and_the_count():
    ranks = run_distributed(_train, WORLD, args=([1, 3], ), fork_server=True)
    assert ranks[0]["engine"] == 2 and ranks[0]["count"] == 2, ranks[0]
    assert ranks[1]["count"] == 2 and ranks[1]["lines"] == [], ranks[1]  # the count on every rank, the lines on 0
    (first_level, first), (second_level, second) = ranks[0]["lines"]
    assert first_level == second_level == "WARNING", ranks[0]["lines"]
    assert "step 2 skipped (inf/NaN in the gradients); 1 skipped so far" in first, first
    assert "step 4 skipped (inf/NaN in the gradients); 2 skipped so far" in second, second


@pytest.mark.fails_unpatched
def test_steps_skipped_in_a_row_get_a_louder_line():
    """Steps 1 - 3 skipped: two WARNINGs, then an ERROR that says three in a row and that the job is not learning."""
    lines = run_distributed(_train, WORLD, args=([1, 2, 3], ), fork_server=True)[0]["lines"]
    assert [level for level, _ in lines] == ["WARNING", "WARNING", "ERROR"], lines
    assert "3 steps skipped in a row, 3 so far: the job is not learning" in lines[2][1], lines[2]


@fails_unpatched_if(per_param_tracker())  # before 0.17.1 unpatched DeepSpeed crashes on a bf16 inf
def test_the_switch_turns_the_lines_and_the_count_off_and_no_host_read_is_added():
    with_log = run_distributed(_train, WORLD, args=([1], ), fork_server=True)
    without = run_distributed(_train, WORLD, args=([1], ), env={SKIP_LOG: "0"}, fork_server=True)
    for rank in range(WORLD):
        assert without[rank]["lines"] == [] and without[rank]["count"] == 0, without[rank]
        assert without[rank]["engine"] == with_log[rank]["engine"] == 1
        # The line is said from the engine's own Python count: every step's host syncs are as without it.
        assert with_log[rank]["syncs"] == without[rank]["syncs"], (with_log[rank], without[rank])


def test_revert_puts_the_engine_s_method_back_and_apply_wraps_it_once():
    assert_ok(
        run_python("""
        import deepspeed_offload_patch as dop
        from deepspeed.runtime.engine import DeepSpeedEngine as cls
        from deepspeed_offload_patch import skip_log
        dop.apply()
        wrapper = cls.__dict__["_take_model_step"]
        original = wrapper.__wrapped__
        assert skip_log.installed() and original.__qualname__ == "DeepSpeedEngine._take_model_step"
        dop.apply()
        assert cls.__dict__["_take_model_step"] is wrapper
        dop.revert()
        assert cls.__dict__["_take_model_step"] is original and not skip_log.installed()
    """))
