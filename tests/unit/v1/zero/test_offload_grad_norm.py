# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The on-device gradient norm (on by default; ``DS_OFFLOAD_PATCH_GRAD_NORM=0`` leaves it out).

It must give the same bits as DeepSpeed's Python loop (so clipping and parameters are identical) and take the
host reads in ``step()`` off the number of parameter tensors, in both of DeepSpeed's forms of the method (a float32
tensor from 0.17.1 on; a Python number before).
"""

import pytest
import torch

import deepspeed_offload_patch
from deepspeed import comm as dist
from deepspeed_offload_patch.hostsync import READ
from deepspeed_offload_patch.testing import count_host_syncs
from deepspeed_offload_patch.testing.launch import run_distributed
from deepspeed_offload_patch.testing.models import batch, ds_config, make_engine, optimizer_step, params_snapshot
from unit.common import DistributedTest


def _deepspeed_original():
    """DeepSpeed's own method, whether or not the grad norm is applied in this process."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed_offload_patch import patcher
    name = "complete_grad_norm_calculation_for_cpu_offload"
    return patcher.originals().get(name, DeepSpeedZeroOptimizer.__dict__[name])


def _replacement():
    """The package's replacement for the installed DeepSpeed's form of the method (where the file already has one of
    them, as with a diff from ``patches/`` applied, that one)."""
    from deepspeed_offload_patch import guard
    from deepspeed_offload_patch.changes import by_name
    change, name = by_name("grad-norm"), "complete_grad_norm_calculation_for_cpu_offload"
    digest = guard.fingerprint(_deepspeed_original())
    same = [func for _, func in change.replacements(name) if guard.fingerprint(func) == digest]
    return same[0] if same else guard.replacement_for(change, name, digest)


class TestGradNormBits(DistributedTest):
    """Norms over a wide range of magnitudes, where a float32 sum or another order would round differently."""
    world_size = 1

    @staticmethod
    def _optimizer(norms):
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        device = get_accelerator().current_device_name()  # where ZeRO keeps the norms: the GPU, on a GPU
        params = [torch.nn.Parameter(torch.zeros(1)) for _ in norms]
        optimizer = DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer)
        optimizer.param_id = {id(p): i for i, p in enumerate(params)}
        optimizer.model_parallel_rank = 0
        optimizer.model_parallel_group = None
        optimizer.dp_process_group = dist.get_world_group()
        optimizer.ignore_unused_parameters = True
        optimizer.device = torch.device(device)
        # Parameters without a norm took no part in the step.
        optimizer.norm_for_param_grads = {i: n.to(device) for i, n in enumerate(norms) if n is not None}
        return optimizer, params

    def _check(self, norms):
        optimizer, params = self._optimizer(norms)
        expected = _deepspeed_original()(optimizer, params)
        got = _replacement()(optimizer, params)
        assert type(got) is type(expected), (got, expected)
        if isinstance(expected, torch.Tensor):
            assert got.dtype == expected.dtype and torch.equal(got, expected), (got.item(), expected.item())
        else:
            assert got == expected, (got, expected)  # Python floats: equal means the same double
        return torch.as_tensor(expected)

    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_same_bits_as_the_python_loop(self, seed):
        generator = torch.Generator().manual_seed(seed)
        magnitudes = 10.0**torch.randint(-6, 7, (300, ), generator=generator)
        self._check(
            [None if i % 7 == 0 else (torch.rand((), generator=generator) * m) for i, m in enumerate(magnitudes)])

    def test_a_float32_sum_would_differ(self):
        # 1 followed by squares of half a float32 ulp of 1: a float32 running sum never moves, a float64 one does.
        norms = [torch.tensor(1.0)] + [torch.tensor(2.0**-12.5)] * 1000
        expected = self._check(norms)
        float32_sum = torch.tensor(0.0)
        for norm in norms:
            float32_sum += norm**2
        assert float32_sum.sqrt().item() != expected.item(), (float32_sum.sqrt().item(), expected.item())


def _train(num_tensors: int, steps: int):
    """Rank job: ZeRO-2 offload with gradient clipping; per step the global norm and step()'s host syncs."""
    engine = make_engine(num_tensors, config=dict(ds_config(stage=2), gradient_clipping=0.05))
    norms, syncs = [], []
    for step in range(steps):
        engine.backward(engine(batch(engine, step)))
        with count_host_syncs(kinds=(READ, )) as counter:
            optimizer_step(engine)
        norms.append(float(engine.get_global_grad_norm()))
        syncs.append(counter.total)
    return {
        "state": deepspeed_offload_patch.status().grad_norm_on_device,
        "norms": norms,
        "syncs": syncs,
        "params": params_snapshot(engine)
    }


UNPATCHED = {"DS_OFFLOAD_PATCH_DISABLE": "1", "DS_OFFLOAD_PATCH_GRAD_NORM": "0"}
DEFAULTS = {"DS_OFFLOAD_PATCH_DISABLE": "0", "DS_OFFLOAD_PATCH_GRAD_NORM": ""}  # empty: the default (on)


@pytest.mark.equivalence
def test_training_with_clipping_is_bit_identical_to_unpatched():
    runs = {
        name: run_distributed(_train, 2, args=(24, 4), env=env, fork_server=True)
        for name, env in (("unpatched", UNPATCHED), ("patched", DEFAULTS))
    }
    # upstream-fixed: DeepSpeed's file already has the on-device norm (the matrix runs this on the diff alone).
    assert all(r["state"] in deepspeed_offload_patch.GOOD_STATES for r in runs["patched"]), runs["patched"]
    for before, after in zip(runs["unpatched"], runs["patched"]):
        assert after["norms"] == before["norms"] and min(before["norms"]) > 0.05, "clipping must be active"
        for name, value in before["params"].items():
            assert torch.equal(after["params"][name], value), name


class TestStepSyncs(DistributedTest):
    world_size = 2

    @pytest.mark.fails_unpatched
    def test_step_syncs_do_not_grow_with_the_tensors(self):
        assert deepspeed_offload_patch.apply().grad_norm_on_device in deepspeed_offload_patch.GOOD_STATES  # default
        counts = {n: _train(n, 2)["syncs"][-1] for n in (16, 64)}
        assert counts[16] == counts[64], f"step() host syncs by parameter tensors: {counts}"

    @pytest.mark.fails_unpatched
    @pytest.mark.parametrize("stage", [1, 2])
    def test_a_whole_optimizer_step_makes_the_same_syncs_at_any_size(self, stage):
        """Every micro-step's forward and backward and every step() of one optimizer step (accumulation 2), with the
        package's defaults: the count is a constant, whatever the number of parameter tensors."""
        deepspeed_offload_patch.apply()
        counts = {n: _whole_step_syncs(n, stage) for n in (16, 64)}
        assert counts[16] == counts[64], f"host syncs per optimizer step by parameter tensors: {counts}"


def _whole_step_syncs(num_tensors: int, stage: int) -> int:
    """Host syncs in this rank's second optimizer step (the first builds DeepSpeed's buffers)."""
    engine = make_engine(num_tensors, config=ds_config(stage=stage, grad_accum=2))
    for step in range(2):
        with count_host_syncs(kinds=(READ, )) as counter:
            for micro in range(2):
                engine.backward(engine(batch(engine, 2 * step + micro)))
                optimizer_step(engine)
    return counter.total
