# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""What a skipped step must be: a job with one inf/NaN, step by step, against the same job in which DeepSpeed leaves
out that step's update itself.

:func:`train` trains an :class:`~deepspeed_offload_patch.testing.outcomes.Cell` on this rank and keeps, before the
first step and after each, everything a step can change (:func:`snapshot`): the full parameters, the fp32 master
partitions, the optimizer's state, the loss scale, the engine's counts of steps and skipped steps and the global
gradient norm. With ``reference=True`` no fault is put in; instead, at the faulty step, the optimizer is told that its
gradients overflowed, as DeepSpeed's own check would tell it (``optimizer.overflow = True`` before ``engine.step()``,
and ``check_overflow`` answering the same where the step runs it), and DeepSpeed takes its own overflow path: the
step is counted as skipped, the gradients are cleared, the loss scale moves as DeepSpeed moves it, nothing else
changes. Where DeepSpeed's step checks (fp16), that reference must equal DeepSpeed's own skip of a real fault bit for
bit, which is how the suite knows the reference means what DeepSpeed means; where it does not (bf16 and fp32 ZeRO-3
before 0.19.8, the fix off), the reference is the skip DeepSpeed would have made.

A fixed job with the fault must match that reference bit for bit at every snapshot (:func:`differences`).
"""

from typing import Any, Dict, List, Optional, Tuple

import torch

from deepspeed_offload_patch.testing import oracle, outcomes


def _master(optimizer) -> List[torch.Tensor]:
    """The fp32 master partitions this rank holds (ZeRO-3's flat groups, ZeRO-1/2's single partitions)."""
    groups = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    if groups is None:
        groups = optimizer.single_partition_of_fp32_groups
    return [group.detach().float().cpu().clone() for group in groups]


def _state(optimizer) -> Dict[str, torch.Tensor]:
    """The wrapped torch optimizer's state, by parameter group, parameter and key, as tensors."""
    found = {}
    inner = optimizer.optimizer
    for g, group in enumerate(inner.param_groups):
        for p, param in enumerate(group["params"]):
            for key, value in inner.state.get(param, {}).items():
                found[f"{g}.{p}.{key}"] = (value.detach().float().cpu().clone()
                                           if torch.is_tensor(value) else torch.tensor(float(value)))
    return found


def snapshot(engine, stage: int) -> Dict[str, Any]:
    """Everything a step of ``engine`` can change, on this rank, on the CPU."""
    norm = engine.get_global_grad_norm()
    return {
        "params": oracle.full_parameters(engine, stage),
        "master": _master(engine.optimizer),
        "state": _state(engine.optimizer),
        "loss_scale": float(engine.optimizer.loss_scale),
        "global_steps": int(engine.global_steps),
        "skipped": int(engine.skipped_steps),
        "grad_norm": None if norm is None else float(norm),
    }


def train(cell: outcomes.Cell, reference: bool = False, fault: bool = True) -> List[Dict[str, Any]]:
    """:func:`snapshot` before the first step and after each of ``outcomes.STEPS``, training ``cell`` on this rank
    (``deepspeed.comm`` initialized). ``fault=False`` puts no fault in; ``reference=True`` puts none in either and has
    DeepSpeed skip the faulty step itself (the module's doc). Raises what DeepSpeed raises."""
    import deepspeed
    from deepspeed import comm as dist

    from deepspeed_offload_patch.testing import allow_fp16_on_cpu, zero3_gather

    if cell.precision == "fp16":
        allow_fp16_on_cpu()
    if cell.stage == 3:
        zero3_gather.wait_every_gather()
    rank = dist.get_rank()
    engine, _, _, _ = deepspeed.initialize(model=oracle.model(), config=cell.config())
    dtype = {"fp16": torch.float16, "fp32": torch.float32}.get(cell.precision, torch.bfloat16)
    armed = [False]
    next(iter(engine.module.parameters())).register_hook(outcomes._fault_hook(cell, armed))
    found = [snapshot(engine, cell.stage)]
    for step in range(outcomes.STEPS):
        for micro in range(cell.grad_accum):
            boundary = step == outcomes.FAULT_STEP and micro == cell.grad_accum - 1
            armed[0] = fault and not reference and boundary and (cell.every_rank or rank == 0)
            engine.backward(engine(oracle.inputs(step, micro, rank).to(engine.device, dtype)))
            optimizer = engine.optimizer
            if reference and boundary:
                optimizer.overflow = True
                optimizer.check_overflow = lambda *args, **kwargs: setattr(optimizer, "overflow", True)
            with torch.no_grad():  # as the oracle: 0.18.7 - 0.18.9 fail in grad mode
                engine.step()
            if reference and boundary:
                # DeepSpeed's check clears the flag at the next step where the step runs it; bf16 and fp32 steps
                # without the fix never do.
                del optimizer.check_overflow
                optimizer.overflow = False
        found.append(snapshot(engine, cell.stage))
    return found


def train_many(runs) -> Dict[str, Any]:
    """:func:`train` for each ``(key, cell, reference, fault)`` of ``runs`` on this rank, by key, with the package's
    state of each change under ``"status"``: what a rank of the suite's runs calls."""
    import warnings

    import deepspeed_offload_patch
    from deepspeed_offload_patch.changes import CHANGES

    warnings.simplefilter("ignore", FutureWarning)
    found: Dict[str, Any] = {key: train(cell, reference, fault) for key, cell, reference, fault in runs}
    status = deepspeed_offload_patch.status()
    found["status"] = {change.name: str(status.of(change)[0]) for change in CHANGES}
    return found


def train_each(runs, world: int, env: Optional[Dict[str, str]] = None) -> List[Dict[str, Any]]:
    """:func:`train_many` of each run of ``runs`` in its own ``world`` ranks (a job that crashes or parts its ranks
    cannot take the other runs with it), by rank: a run whose ranks failed gives, on every rank, the error in a few
    words (a ``str``) instead of its snapshots; ``"status"`` is the last run's."""
    from deepspeed_offload_patch.testing.launch import run_distributed

    found: List[Dict[str, Any]] = [{} for _ in range(world)]
    for run in runs:
        try:
            ranks = run_distributed(train_many, world, args=([run], ), env=env, fork_server=True)
        except Exception as exc:  # the job's own failure: DeepSpeed raised, or the ranks parted
            # The traceback's last line: what DeepSpeed raised, or how the ranks parted.
            last = (str(exc).strip().splitlines() or [""])[-1]
            ranks = [{run[0]: f"{type(exc).__name__}: {last}"[:300]} for _ in range(world)]
        for rank in range(world):
            found[rank].update(ranks[rank])
    return found


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):
        return torch.equal(a, b) or bool(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def differences(found: List[Dict[str, Any]], expected: List[Dict[str, Any]]) -> List[str]:
    """What differs, bit for bit, between two :func:`train` results: ``"after step 2: master"`` and the like (the
    first snapshot is ``before the steps``); empty when they are the same. A side that is :func:`train_each`'s error
    is a difference."""
    failed = [
        f"{side} failed: {result}" for side, result in (("found", found), ("expected", expected))
        if isinstance(result, str)
    ]
    if failed:
        return failed
    problems = []
    for n, (a, b) in enumerate(zip(found, expected)):
        when = "before the steps" if n == 0 else f"after step {n - 1}"
        problems += [f"{when}: {key}" for key in b if not _same(a.get(key), b[key])]
    if len(found) != len(expected):
        problems.append(f"{len(found)} snapshots, not {len(expected)}")
    return problems


def skip_problems(found: List[Dict[str, Any]]) -> List[str]:
    """How the faulty step of one :func:`train` result is not a skip: a change to the parameters, master weights or
    optimizer state, a step not counted as skipped, a non-finite value later, or a later step that learned nothing; or
    the job's failure, where ``found`` is :func:`train_each`'s error."""
    if isinstance(found, str):
        return [f"the job failed: {found}"]
    problems = []
    before, at = found[outcomes.FAULT_STEP], found[outcomes.FAULT_STEP + 1]
    problems += [
        f"the faulty step changed the {key}" for key in ("params", "master", "state")
        if not _same(at[key], before[key])
    ]
    if at["skipped"] != before["skipped"] + 1:
        problems.append(f"the faulty step was not counted as skipped (skipped {before['skipped']} -> {at['skipped']})")
    for n, shot in enumerate(found[outcomes.FAULT_STEP + 2:], start=outcomes.FAULT_STEP + 1):
        if not all(bool(torch.isfinite(p).all()) for p in shot["params"].values()):
            problems.append(f"non-finite parameters after step {n}")
        if _same(shot["params"], found[n]["params"]):
            problems.append(f"step {n} changed nothing")
    return problems


def step_host_syncs(cell: outcomes.Cell, tensors: int) -> Dict[str, int]:
    """Host syncs of one optimizer step of ``cell``'s job (no fault) on a model of ``tensors`` parameter tensors, on
    this rank: ``{"backward": ..., "step": ...}``, counted in the boundary micro-step's backward and in
    ``engine.step()`` of the second optimizer step (the first builds state)."""
    import deepspeed
    from deepspeed import comm as dist

    from deepspeed_offload_patch.hostsync import READ, count_host_syncs
    from deepspeed_offload_patch.testing.models import ManyLinear

    rank = dist.get_rank()
    torch.manual_seed(oracle.SEED)
    engine, _, _, _ = deepspeed.initialize(model=ManyLinear(tensors, oracle.HIDDEN), config=cell.config())
    dtype = {"fp16": torch.float16, "fp32": torch.float32}.get(cell.precision, torch.bfloat16)
    found = {}
    for step in range(2):
        for micro in range(cell.grad_accum):
            counting = step == 1 and micro == cell.grad_accum - 1
            with count_host_syncs(kinds=(READ, )) as backward:
                engine.backward(engine(oracle.inputs(step, micro, rank).to(engine.device, dtype)))
            with count_host_syncs(kinds=(READ, )) as stepped, torch.no_grad():
                engine.step()
            if counting:
                found = {"backward": backward.total, "step": stepped.total}
    return found


def step_syncs_by_size(cells: List[outcomes.Cell], sizes: Tuple[int, ...]) -> Dict[str, Dict[str, int]]:
    """:func:`step_host_syncs` of each cell at each number of tensors, by ``"<cell>-<tensors>"``, on this rank."""
    return {f"{cell.name}-{n}": step_host_syncs(cell, n) for cell in cells for n in sizes}


def added_read_problems(found: Dict[str, Dict[str, int]], without: Dict[str, Dict[str, int]],
                        cells: List[outcomes.Cell], sizes: Tuple[int, ...]) -> List[str]:
    """How a fix that may add one host read per step breaks that promise, from :func:`step_syncs_by_size` with the
    fix (``found``) and without it: a step whose syncs differ between the sizes, a backward whose syncs the fix
    changed, or a step with more than one sync more (or fewer) than without the fix. Empty when it keeps it."""
    problems = []
    for cell in cells:
        steps = [found[f"{cell.name}-{n}"]["step"] for n in sizes]
        if len(set(steps)) != 1:
            problems.append(f"{cell.name}: the step's host syncs grow with the tensors: {dict(zip(sizes, steps))}")
        for n in sizes:
            key = f"{cell.name}-{n}"
            if found[key]["backward"] != without[key]["backward"]:
                problems.append(f"{key}: backward {without[key]['backward']} -> {found[key]['backward']}")
            if not without[key]["step"] <= found[key]["step"] <= without[key]["step"] + 1:
                problems.append(f"{key}: step {without[key]['step']} -> {found[key]['step']}")
    return problems
