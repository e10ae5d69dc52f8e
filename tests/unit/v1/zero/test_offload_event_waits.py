# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The event-wait fix (opt-in: ``DS_OFFLOAD_PATCH_EVENT_WAITS=1``): on DeepSpeed 0.19.8, ZeRO-2 offload with gradient
accumulation makes the host wait on an event before each parameter tensor of every backward, and once per tensor when
it restores the accumulated gradients at an unmanaged boundary. With the fix, a pinned buffer makes no host wait in a
backward and a pageable one one per backward; the results are the same bits.

On the CPU accelerator events are no-ops, so the package's counter counts DeepSpeed's own wait points
(``_wait_for_offload_copies`` once a copy was recorded since the last one): the structure a GPU has. Each job is
trained with the fix switched on (the rest as this process's switches say: the red/green run disables the package) at
8 and 32 parameter tensors, and with it off at 8 (and 32 for one job) as the reference.
"""

from collections import Counter
from typing import Any, Dict, List, Tuple

import pytest
import torch

from deepspeed_offload_patch.changes import by_name
from deepspeed_offload_patch.settings import DISABLE, disabled
from deepspeed_offload_patch.testing.installed import has_defect
from deepspeed_offload_patch.testing.launch import run_distributed

EVENT_WAITS = by_name("event-waits")
DEFECT = has_defect(EVENT_WAITS.name)
SIZES = (8, 32)
STEPS = 3
#: ``(name, pin_memory, managed)``: managed accumulation over 2 micro-steps, or 2 backwards per ``step()`` with
#: ``managed_gradient_accumulation: false`` (the boundary restores each tensor's sum from the CPU buffer).
JOBS = (("managed-pageable", False, True), ("managed-pinned", True, True), ("unmanaged-pageable", False, False),
        ("unmanaged-pinned", True, False))
BACKWARDS = 2
MARKS = (pytest.mark.fails_unpatched, ) if DEFECT else ()
ON = {EVENT_WAITS.switch: "1"}
OFF = {DISABLE: "0", EVENT_WAITS.switch: "0"}


def _train(job: Tuple[str, bool, bool], tensors: int) -> Dict[str, Any]:
    """Train ``STEPS`` steps; the host waits of each step's backwards and of its ``step()``, and the final state."""
    from deepspeed_offload_patch import status
    from deepspeed_offload_patch.hostsync import count_host_syncs
    from deepspeed_offload_patch.testing.models import batch, ds_config, make_engine, optimizer_step

    _, pin, managed = job
    config = ds_config(stage=2, dtype="bf16", grad_accum=BACKWARDS if managed else 1)
    config["zero_optimization"]["offload_optimizer"]["pin_memory"] = pin
    if not managed:
        config["managed_gradient_accumulation"] = False
    engine = make_engine(num_tensors=tensors, config=config)
    waits: List[Tuple[Dict[str, int], Dict[str, int]]] = []
    losses = []
    for step in range(STEPS):
        backward, stepped = Counter(), Counter()
        for micro in range(BACKWARDS):
            with count_host_syncs(device="cpu") as counted:
                loss = engine(batch(engine, step * BACKWARDS + micro)).float().pow(2).mean()
                engine.backward(loss)
            backward.update(counted.by_kind)
            losses.append(loss.detach().clone())
            if managed or micro == BACKWARDS - 1:
                # Managed: each micro-step's step() (the update at the boundary); unmanaged: one step() per step.
                with count_host_syncs(device="cpu") as counted:
                    optimizer_step(engine)
                stepped.update(counted.by_kind)
        waits.append((dict(backward), dict(stepped)))
    optimizer = engine.optimizer
    return {
        "waits":
        waits,
        "losses":
        torch.stack(losses),
        "params": [p.detach().clone() for p in engine.module.parameters()],
        "master": [p.detach().clone() for p in optimizer.single_partition_of_fp32_groups],
        "state": [{
            k: v.clone()
            for k, v in optimizer.optimizer.state[p].items()
        } for p in optimizer.single_partition_of_fp32_groups],
        "status":
        str(status().of(EVENT_WAITS)[0]),
    }


def _train_all(runs: List[Tuple[Tuple[str, bool, bool], int]]) -> Dict[Tuple[str, int], Dict[str, Any]]:
    return {(job[0], tensors): _train(job, tensors) for job, tensors in runs}


@pytest.fixture(scope="module")
def trained() -> Dict[str, Dict[Tuple[str, int], Dict[str, Any]]]:
    """Every job at both sizes with the fix on; at 8 tensors (and the first job at 32 too) with it off."""
    found = [(job, tensors) for job in JOBS for tensors in SIZES]
    reference = [(job, SIZES[0]) for job in JOBS] + [(JOBS[0], SIZES[1])]
    return {
        "found": run_distributed(_train_all, 1, args=(found, ), env=ON, fork_server=True)[0],
        "reference": run_distributed(_train_all, 1, args=(reference, ), env=OFF, fork_server=True)[0],
    }


def _event_waits(result: Dict[str, Any]) -> List[Tuple[int, int]]:
    """Each step's host event waits: ``(in its backwards, in its step())``."""
    return [(backward["event wait"], stepped["event wait"]) for backward, stepped in result["waits"]]


@pytest.mark.parametrize("job", [pytest.param(job, marks=MARKS, id=job[0]) for job in JOBS])
def test_host_waits_per_step_do_not_grow_with_the_tensors(trained, job):
    small, large = (trained["found"][job[0], tensors] for tensors in SIZES)
    assert _event_waits(small) == _event_waits(large), (_event_waits(small), _event_waits(large))


@pytest.mark.parametrize("job", [pytest.param(job, marks=MARKS, id=job[0]) for job in JOBS])
def test_a_backward_waits_on_the_host_once_when_pageable_and_never_when_pinned(trained, job):
    _, pin, _ = job
    for tensors in SIZES:
        waits = _event_waits(trained["found"][job[0], tensors])
        most = 0 if pin else BACKWARDS
        assert all(backward <= most for backward, _ in waits), (tensors, waits)
        assert all(stepped <= 1 + (not pin) for _, stepped in waits), (tensors, waits)


@pytest.mark.parametrize("job", [pytest.param(job, id=job[0]) for job in JOBS])
def test_the_same_bits_as_with_the_fix_off(trained, job):
    found, expected = trained["found"][job[0], SIZES[0]], trained["reference"][job[0], SIZES[0]]
    assert torch.equal(found["losses"], expected["losses"])
    for key in ("params", "master"):
        assert all(torch.equal(a, b) for a, b in zip(found[key], expected[key], strict=True)), key
    for mine, theirs in zip(found["state"], expected["state"], strict=True):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_the_counter_sees_deepspeeds_wait_per_tensor(trained):
    """With the fix off, the counter sees a wait per tensor where DeepSpeed has them (2 backwards of N tensors: all
    but the first tensor of the first backward, and the step's), and none where it has no such wait."""
    small, large = (_event_waits(trained["reference"][JOBS[0][0], tensors]) for tensors in SIZES)
    if DEFECT:
        assert [sum(step) for step in small] == [2 * SIZES[0]] * STEPS, small
        assert [sum(step) for step in large] == [2 * SIZES[1]] * STEPS, large
    else:
        assert small == large, (small, large)


def test_switched_on_the_fix_applies_where_deepspeed_waits_per_tensor(trained):
    """``applied`` on a release with the waits, ``not-needed`` on one without; ``off`` with its switch at 0 (every
    change ``disabled`` where the process disables the package)."""
    found = {result["status"] for result in trained["found"].values()}
    reference = {result["status"] for result in trained["reference"].values()}
    assert reference == {"off"}, reference
    expected = "disabled" if disabled() else "applied" if DEFECT else "not-needed"
    assert found == {expected}, found


def _verify_check() -> Dict[str, bool]:
    from deepspeed_offload_patch.verify import _waits_per_backward
    return _waits_per_backward("bf16")


@pytest.mark.parametrize("switched_on", [pytest.param(True, marks=MARKS, id="on"), pytest.param(False, id="off")])
def test_verifys_check_passes_with_the_fix_and_fails_without_it_where_deepspeed_waits_per_tensor(switched_on):
    found = run_distributed(_verify_check, 1, env=ON if switched_on else OFF, fork_server=True)[0]
    assert all(found.values()) == (switched_on or not DEFECT), found
