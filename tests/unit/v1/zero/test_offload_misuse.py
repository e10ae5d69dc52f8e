# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Optimizer subclasses that override one of the two patched methods: training stays correct, bad steps are skipped
on every rank and the others train. (``revert()`` with live engines: ``tests/unit/test_revert_live_engines.py``.)"""

import pytest
import torch

import deepspeed_offload_patch  # noqa: F401  (applies the patch, unless DS_OFFLOAD_PATCH_DISABLE=1)
from deepspeed import comm as dist
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed_offload_patch.testing.equivalence import backward_to_boundary, flag_is_read, poison_plan
from deepspeed_offload_patch.testing.models import ds_config, make_engine, optimizer_step, params_snapshot
from unit.common import DistributedTest

NUM_TENSORS = 12
ORIGINAL_MODULE = DeepSpeedZeroOptimizer.__module__


def _step(engine, step: int, bad: bool = False) -> None:
    """One optimizer step of 2 micro-steps; with ``bad``, a NaN in one gradient on rank 1 at the boundary (on every
    parameter of every rank where DeepSpeed does not all-reduce the flag over ranks)."""
    _backward(engine, step, bad)
    optimizer_step(engine)


def _backward(engine, step: int, bad: bool) -> None:
    """The micro-steps of one optimizer step, up to and including the boundary backward (not its step())."""
    poison, ranks = poison_plan(engine, engine.zero_optimization_stage(), engine.module.layers[2].weight,
                                1) if bad else ((), ())
    backward_to_boundary(engine, step, poison, ranks, value=float("nan"))


def _assert_trains(engine, step: int, bad: bool) -> None:
    before, skipped = params_snapshot(engine), engine.skipped_steps
    _step(engine, step, bad)
    changed = any(not torch.equal(v, before[k]) for k, v in params_snapshot(engine).items())
    assert engine.skipped_steps == skipped + bad, f"rank {dist.get_rank()}, step {step}: skipped {engine.skipped_steps}"
    assert changed != bad, f"rank {dist.get_rank()}, step {step}: parameters {'changed' if changed else 'unchanged'}"


class OwnTracker(DeepSpeedZeroOptimizer):
    """Overrides the tracker (in both of DeepSpeed's forms) with DeepSpeed's old behaviour (a Python bool); the
    patch's has_overflow reads it."""

    def update_offload_overflow_tracker(self, grad):
        if grad is not None and self._has_inf_or_nan(grad.data):
            self.local_overflow = True

    def update_overflow_tracker_for_param_grad(self, param):
        self.update_offload_overflow_tracker(self.get_param_gradient_attribute(param))


class OwnHasOverflow(DeepSpeedZeroOptimizer):
    """Overrides has_overflow and reads the flag its own way; the patch's tracker leaves it a device tensor."""

    def has_overflow(self, partition_gradients=True):
        flag = torch.tensor([float(self.local_overflow)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.dp_process_group)
        return bool(flag.item())


class TestSubclassOverridingOneMethod(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("zero_stage", [1, 2])
    @pytest.mark.parametrize("subclass", [OwnTracker, OwnHasOverflow], ids=lambda cls: cls.__name__)
    def test_trains_correctly(self, subclass, zero_stage):
        # A precision whose flag step() reads: bf16 from DeepSpeed 0.17.1, fp16 before.
        precision = "bf16" if flag_is_read("bf16") else "fp16"
        engine = make_engine(NUM_TENSORS, config=ds_config(stage=zero_stage, dtype=precision, grad_accum=2))
        engine.optimizer.__class__ = subclass
        for step, bad in enumerate([False, True, True, False]):
            _assert_trains(engine, step, bad)
