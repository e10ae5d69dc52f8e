# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Regression tests for the device-side offload overflow flag of ZeRO-1/2 (DeepSpeed pull request 8963).

Each test runs on 2 ranks with the optimizer offloaded to the CPU, torch's Adam and the CPU accelerator, in bf16
and in fp16 (dynamic loss scaling; the test helpers let the CPU accelerator run it). Where the installed DeepSpeed's
``step()`` does not read the flag (bf16 before 0.17.1, which checks overflow in fp16 only), the tests assert what
both patched and unpatched DeepSpeed do there: nothing is skipped, and the patched tracker checks nothing.
Tests marked ``fails_unpatched`` exist for the patch: with ``DS_OFFLOAD_PATCH_DISABLE=1`` they must fail, and
``ci/check_red_green.py`` checks that they do (and that the others still pass).
"""

import pytest
import torch

import deepspeed_offload_patch  # noqa: F401  (applies the patch, unless DS_OFFLOAD_PATCH_DISABLE=1)
from deepspeed import comm as dist
from deepspeed_offload_patch.testing import RaisingBoolTensor
from deepspeed_offload_patch.changes import UPSTREAM
from deepspeed_offload_patch.testing.equivalence import (backward_to_boundary, flag_is_read, poison_plan,
                                                         ranks_agree_on_overflow, set_full_grad_reaches_tracker)
from deepspeed_offload_patch.testing.models import batch, ds_config, make_engine, optimizer_step, params_snapshot
from unit.common import DistributedTest

NUM_TENSORS = 16
PRECISIONS = ["bf16", "fp16"]


def _holds_first_element(optimizer, param) -> bool:
    """Whether this rank's partition holds ``param``'s first element (where poison_grad puts the bad value)."""
    position = optimizer.grad_position.get(optimizer.get_param_id(param))
    return position is not None and position[1] == 0


def _assert_skipped_and_unchanged(engine, before, skipped: int) -> None:
    assert engine.skipped_steps == skipped, f"rank {dist.get_rank()}: skipped {engine.skipped_steps}, not {skipped}"
    after = params_snapshot(engine)
    for name, value in before.items():
        assert torch.equal(after[name], value), f"rank {dist.get_rank()}: {name} changed in a skipped step"
        assert not torch.isnan(after[name]).any(), name


def _trains(engine, before) -> bool:
    return any(not torch.equal(value, before[name]) for name, value in params_snapshot(engine).items())


class TestOffloadOverflowFlag(DistributedTest):
    world_size = 2

    @pytest.mark.fails_unpatched
    @pytest.mark.parametrize("precision", PRECISIONS)
    @pytest.mark.parametrize("zero_stage", [1, 2])
    def test_flag_never_truth_tested(self, zero_stage, precision):
        engine = make_engine(NUM_TENSORS, config=ds_config(stage=zero_stage, dtype=precision, grad_accum=2))
        optimizer = engine.optimizer
        check = optimizer._has_inf_or_nan
        # Every result of the check becomes a tensor whose truth value raises: an `if` on it fails the test.
        optimizer._has_inf_or_nan = lambda x, j=None: RaisingBoolTensor.wrap(check(x, j))
        params, ranks = poison_plan(engine, zero_stage, engine.module.layers[3].weight, 0)

        backward_to_boundary(engine, 0, params, ranks, value=float("inf"))
        flag = optimizer.local_overflow
        if not flag_is_read(precision):
            # Nothing reads the flag (bf16 before DeepSpeed 0.17.1): the tracker checked nothing. (No step: there
            # DeepSpeed's step() fails on an inf gradient, patched or not; see bad_gradients_survive.)
            assert flag is False, type(flag)
            return
        assert isinstance(flag, RaisingBoolTensor) and flag.dtype == torch.bool, type(flag)
        assert RaisingBoolTensor.plain(flag).item() == any(_holds_first_element(optimizer, p) for p in params)
        optimizer_step(engine)
        assert engine.skipped_steps == 1
        assert optimizer.local_overflow is False, "the flag is reset after the step"

        backward_to_boundary(engine, 1)
        assert not RaisingBoolTensor.plain(optimizer.local_overflow).item()
        optimizer_step(engine)
        assert engine.skipped_steps == 1 and optimizer.local_overflow is False

    @pytest.mark.fails_unpatched
    @pytest.mark.parametrize("accum_dtype", [None, "fp32"])
    @pytest.mark.parametrize("precision", PRECISIONS)
    @pytest.mark.parametrize("zero_stage", [1, 2])
    def test_boundary_backward_has_no_host_sync(self, zero_stage, precision, accum_dtype, host_sync_counter):
        # fp16 starts from a loss scale of 2**24, so that the first steps overflow, as fp16 runs do; not where the ranks
        # do not agree on overflow (ZeRO-1 on 0.17.x), where one rank's overflow alone would make them abort.
        # accum_dtype fp32 accumulates gradients in fp32 (at ZeRO-1 in a per-parameter attribute): the configuration
        # of the upstream report (bf16, ZeRO-1).
        power = 24 if ranks_agree_on_overflow(zero_stage) else 8
        config = ds_config(stage=zero_stage,
                           dtype=precision,
                           grad_accum=2,
                           initial_scale_power=power,
                           grad_accum_dtype=accum_dtype)
        engine = make_engine(NUM_TENSORS, config=config)
        for step in range(3):
            engine.backward(engine(batch(engine, 2 * step)))
            optimizer_step(engine)
            loss = engine(batch(engine, 2 * step + 1))
            assert engine.is_gradient_accumulation_boundary()
            with host_sync_counter(kinds=("read", )) as syncs:  # the reads: what the fix removes
                engine.backward(loss)
            assert syncs.total == 0, f"rank {dist.get_rank()}: {syncs.counts} at {syncs.events[:3]}"
            optimizer_step(engine)
        if precision == "fp16" and power == 24:
            assert engine.skipped_steps > 0 and engine.optimizer.loss_scale < 2**24, "the loss scale never overflowed"
        else:
            assert engine.skipped_steps == 0

    # Where step() reads the flag: fp16 on every release, bf16 from DeepSpeed 0.17.1.
    @pytest.mark.parametrize("precision", [p for p in PRECISIONS if flag_is_read(p)])
    @pytest.mark.parametrize("zero_stage", [1, 2])
    def test_nan_skips_step_on_every_rank(self, zero_stage, precision):
        engine = make_engine(NUM_TENSORS, config=ds_config(stage=zero_stage, dtype=precision, grad_accum=2))
        backward_to_boundary(engine, 0)
        optimizer_step(engine)
        before = params_snapshot(engine)

        # NaN in one parameter's gradient on rank 1 only: both ranks skip, nothing changes.
        params, ranks = poison_plan(engine, zero_stage, engine.module.layers[5].bias, 1)
        backward_to_boundary(engine, 1, params, ranks, value=float("nan"))
        optimizer_step(engine)
        _assert_skipped_and_unchanged(engine, before, skipped=1)

        # The flag was reset: the next step trains.
        backward_to_boundary(engine, 2)
        optimizer_step(engine)
        assert engine.skipped_steps == 1
        assert _trains(engine, before)

    @pytest.mark.fails_unpatched
    @pytest.mark.parametrize("zero_stage", [1, 2])
    def test_check_off_checks_nothing(self, zero_stage):
        engine = make_engine(NUM_TENSORS, config=ds_config(stage=zero_stage, check_grad_overflow=False, grad_accum=2))
        optimizer = engine.optimizer
        calls = []
        check = optimizer._has_inf_or_nan

        def counting_check(x, j=None):
            calls.append(1)
            return check(x, j)

        optimizer._has_inf_or_nan = counting_check
        before = params_snapshot(engine)
        backward_to_boundary(engine, 0)
        optimizer_step(engine)
        assert calls == [], f"rank {dist.get_rank()}: {len(calls)} gradients checked with the check off"
        assert engine.skipped_steps == 0
        assert _trains(engine, before)


# safe_set_full_grad reaches the tracker from DeepSpeed 0.17.1 (0.14.0 has no safe_set_full_grad; up to 0.17.0 it
# bypasses the tracker): before that there is no such path to test.
if set_full_grad_reaches_tracker():

    class TestOffloadOverflowFlagSetFullGrad(DistributedTest):
        world_size = 2

        @pytest.mark.parametrize("precision", PRECISIONS)
        @pytest.mark.parametrize("zero_stage", [1, 2])
        def test_nan_through_safe_set_full_grad(self, zero_stage, precision):
            from deepspeed.utils import safe_set_full_grad  # not in every release (0.14.x has none)

            # Also with a CPU value on an accelerator: the flag lives on the accelerator and takes the CPU result.
            engine = make_engine(NUM_TENSORS, config=ds_config(stage=zero_stage, dtype=precision))
            backward_to_boundary(engine, 0)
            optimizer_step(engine)
            before = params_snapshot(engine)

            backward_to_boundary(engine, 1)
            # One rank sets, as a CPU tensor, a full gradient with one NaN for a parameter whose partition it holds.
            setter = 0 if ranks_agree_on_overflow(zero_stage) else dist.get_rank()
            if dist.get_rank() == setter:
                target = next(p for p in engine.module.parameters() if p._hp_mapping is not None)
                value = torch.zeros(target.shape, dtype=torch.float32, device="cpu")
                value.view(-1)[0] = float("nan")
                safe_set_full_grad(target, value)
            optimizer_step(engine)
            _assert_skipped_and_unchanged(engine, before, skipped=1)


def _with_grad(grad):
    param = torch.nn.Parameter(torch.zeros_like(grad) if grad is not None else torch.zeros(1))
    param.grad = grad
    return param


class TestOptimizerBuiltWithoutInit(DistributedTest):
    """Tools and tests build the optimizer with ``__new__`` and set attributes by hand (DeepSpeed's own
    ``test_zero2_gradient_safety.py`` does): the methods must work on such an object, which may lack
    ``check_grad_overflow`` (the constructor's default, True, applies)."""
    world_size = 1

    @pytest.mark.parametrize("bad", [None, float("nan"), float("inf")])
    def test_new_optimizer(self, bad):
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        optimizer = DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer)
        optimizer.cpu_offload = True
        optimizer.local_overflow = False
        optimizer.dp_process_group = dist.get_world_group()
        optimizer.model_parallel_group = None
        optimizer.model_parallel_world_size = 1
        optimizer.mpu = None
        assert not hasattr(optimizer, "check_grad_overflow")
        grads = [torch.ones(4), torch.ones(3, 2), None]
        if bad is not None:
            grads[1][1, 1] = bad
        tracker = UPSTREAM.form_for(DeepSpeedZeroOptimizer).tracker
        for grad in grads:
            if tracker == "update_offload_overflow_tracker":
                optimizer.update_offload_overflow_tracker(grad)
            else:  # 0.14.0 to 0.17.0: the tracker takes the parameter, whose gradient is in .grad
                optimizer.use_grad_accum_attribute = False
                optimizer.update_overflow_tracker_for_param_grad(_with_grad(grad))
        assert optimizer.has_overflow() is (bad is not None)
