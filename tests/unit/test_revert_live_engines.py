# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""``revert()`` on live engines, between the boundary backward and ``step()``: they train on correctly with
DeepSpeed's own methods. A test of the monkey-patch's revert, so not among the ZeRO tests that the version matrix
also runs on a DeepSpeed patched with the diff."""

import pytest
import torch

import deepspeed_offload_patch
from deepspeed import comm as dist
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed_offload_patch.testing.models import ds_config, make_engine, optimizer_step, params_snapshot
from unit.common import DistributedTest
from unit.v1.zero.test_offload_misuse import NUM_TENSORS, ORIGINAL_MODULE, _assert_trains, _backward, _step


class TestRevertWithLiveEngines(DistributedTest):
    world_size = 2

    @pytest.mark.fails_unpatched
    @pytest.mark.parametrize("bad", [False, True])
    def test_revert_between_backward_and_step(self, bad):
        engine = make_engine(NUM_TENSORS, config=ds_config(stage=2, grad_accum=2))
        _step(engine, 0)
        _backward(engine, 1, bad)
        # The patched tracker left a device flag; revert() must hand the originals a flag they read correctly.
        assert torch.is_tensor(engine.optimizer.local_overflow), "the patch is not active"
        assert deepspeed_offload_patch.revert().state == "reverted"
        assert {
            DeepSpeedZeroOptimizer.has_overflow.__module__,
            DeepSpeedZeroOptimizer.update_offload_overflow_tracker.__module__
        } == {ORIGINAL_MODULE}
        # Converted to the Python bool DeepSpeed's methods keep there; only the ranks whose partition saw the NaN
        # have True.
        flag = engine.optimizer.local_overflow
        assert type(flag) is bool, repr(flag)
        any_rank = torch.tensor([float(flag)])
        dist.all_reduce(any_rank, op=dist.ReduceOp.MAX)
        assert bool(any_rank.item()) is bad
        before, skipped = params_snapshot(engine), engine.skipped_steps
        optimizer_step(engine)
        assert engine.skipped_steps == skipped + bad
        assert any(not torch.equal(v, before[k]) for k, v in params_snapshot(engine).items()) != bad
        # Then it trains on with DeepSpeed's own methods: a bad step is skipped, the next one trains.
        _assert_trains(engine, 2, bad=True)
        _assert_trains(engine, 3, bad=False)
