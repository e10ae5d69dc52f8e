# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""``ds-offload-patch verify``: the behavioural proof, on this machine, that the fix is active and correct.

A tiny ZeRO-2 engine with the optimizer offloaded to the CPU (world size 1, in a spawned process; the CPU
accelerator, or the GPU DeepSpeed finds), in bf16 (fp16 before DeepSpeed 0.17.1, where only fp16 reads the overflow
flag), trains a few steps with each boundary backward under
:func:`~deepspeed_offload_patch.testing.no_host_sync` for reads of device values (the host syncs the fix removes;
other kinds of host wait, such as 0.19.8's offload event waits, are not this check's), then a NaN gradient must make it skip a step and leave the
parameters unchanged. Then each change that is neither ``not-needed`` nor ``off`` runs the checks its record names
(:data:`CHECKS`): ``step-after-a-skip``, a second engine with ``grad_accum_dtype: fp32`` that gets a NaN at one step
and must skip it and update the parameters at the next; ``every-micro-batch`` and ``every-backward``, ZeRO-2 jobs of
3 micro-steps and of 2 backwards per step whose gradient norms and parameters must be what plain PyTorch computes
(:mod:`deepspeed_offload_patch.testing.oracle`); ``check-left-out``, a bf16 engine whose config leaves out
``check_grad_overflow``, which must skip a step with a NaN gradient; ``waits-per-backward``, ZeRO-2 jobs with
accumulation whose backwards must each make at most one host event wait (none with pinned buffers), the same at two
sizes. Returns 0 when all hold, 1 otherwise.
"""

from typing import Any, Dict

import torch

from deepspeed_offload_patch.changes import OTHERS
from deepspeed_offload_patch.states import State

GRAD_ACCUM = 2


def _verify_rank(steps: int) -> Dict[str, Any]:
    import deepspeed_offload_patch as dop
    from deepspeed_offload_patch.hostsync import READ, HostSyncError, no_host_sync
    from deepspeed_offload_patch.testing.installed import flag_is_read
    from deepspeed_offload_patch.testing.models import batch, ds_config, make_engine, optimizer_step, params_snapshot

    precision = "bf16" if flag_is_read("bf16") else "fp16"
    engine = make_engine(40, config=ds_config(stage=2, dtype=precision, grad_accum=GRAD_ACCUM))
    report: Dict[str, Any] = {
        "state": dop.status().state,
        "device": str(engine.device),
        "precision": precision,
        "sync": None
    }
    for step in range(steps):
        for micro in range(GRAD_ACCUM):
            loss = engine(batch(engine, step * GRAD_ACCUM + micro))
            if engine.is_gradient_accumulation_boundary():
                try:
                    with no_host_sync(kinds=(READ, )):
                        engine.backward(loss)
                except HostSyncError as exc:
                    report["sync"] = str(exc)
                    return report
            else:
                engine.backward(loss)
            optimizer_step(engine)

    before, skipped = params_snapshot(engine), engine.skipped_steps
    poisoned = engine.module.layers[0].weight
    handle = poisoned.register_hook(lambda g: torch.full_like(g, float("nan")))
    for micro in range(GRAD_ACCUM):
        engine.backward(engine(batch(engine, 1000 + micro)))
        optimizer_step(engine)
    handle.remove()
    after = params_snapshot(engine)
    report["nan_skipped"] = engine.skipped_steps == skipped + 1
    report["unchanged"] = all(torch.equal(after[name], value) for name, value in before.items())
    status = dop.status()
    report["checks"] = {}
    for change in OTHERS:
        state = status.of(change)[0]
        if state not in (State.NOT_NEEDED, State.OFF):
            for check in change.verify_checks:
                report["checks"][check] = (change.label, state, CHECKS[check][0](precision))
    report["unchecked"] = [(change.label, status.of(change)[0]) for change in OTHERS
                           if change.verify_checks and status.of(change)[0] in (State.NOT_NEEDED, State.OFF)]
    return report


def _one_step(engine, step: int, nan: bool) -> None:
    """One optimizer step of ``engine`` over ``GRAD_ACCUM`` micro-steps, with a NaN gradient in its first layer when
    ``nan``."""
    from deepspeed_offload_patch.testing.models import batch, optimizer_step

    poisoned = engine.module.layers[0].weight
    handle = poisoned.register_hook(lambda g: torch.full_like(g, float("nan"))) if nan else None
    for micro in range(GRAD_ACCUM):
        engine.backward(engine(batch(engine, 2000 + step * GRAD_ACCUM + micro)))
        optimizer_step(engine)
    if handle is not None:
        handle.remove()


def _step_after_a_skip(precision: str) -> Dict[str, bool]:
    """With fp32 gradient accumulation: a NaN at one step is skipped, and the next step updates the parameters."""
    from deepspeed_offload_patch.testing.models import ds_config, make_engine, params_snapshot

    engine = make_engine(40,
                         config=ds_config(stage=2, dtype=precision, grad_accum=GRAD_ACCUM, grad_accum_dtype="fp32"))
    _one_step(engine, 0, nan=True)
    skipped, before = engine.skipped_steps, params_snapshot(engine)
    _one_step(engine, 1, nan=False)
    after = params_snapshot(engine)
    return {
        "nan_skipped": skipped == 1,
        "next_taken": engine.skipped_steps == skipped,
        "updated": any(not torch.equal(after[name], value) for name, value in before.items()),
    }


def _check_left_out(precision: str) -> Dict[str, bool]:
    """bf16 whose config leaves ``check_grad_overflow`` out, as HF Trainer's and Accelerate's do: a NaN gradient
    skips the step and leaves the parameters unchanged."""
    from deepspeed_offload_patch.testing.models import ds_config, make_engine, params_snapshot

    config = ds_config(stage=2, dtype="bf16", grad_accum=GRAD_ACCUM)
    del config["bf16"]["check_grad_overflow"]
    engine = make_engine(40, config=config)
    before = params_snapshot(engine)
    _one_step(engine, 0, nan=True)
    after = params_snapshot(engine)
    return {
        "nan_skipped": engine.skipped_steps == 1,
        "unchanged": all(torch.equal(after[name], value) for name, value in before.items()),
    }


def _waits_per_backward(precision: str) -> Dict[str, bool]:
    """ZeRO-2 with accumulation, pinned and pageable CPU buffers, at 8 and 24 tensors: each backward's host event
    waits (on the CPU, DeepSpeed's own wait points) are at most one (pageable) or none (pinned), at both sizes."""
    from deepspeed_offload_patch.hostsync import EVENT_WAIT, count_host_syncs
    from deepspeed_offload_patch.testing.models import batch, ds_config, make_engine, optimizer_step

    found = {}
    for pin in (False, True):
        waits = {}
        for tensors in (8, 24):
            config = ds_config(stage=2, dtype=precision, grad_accum=GRAD_ACCUM)
            config["zero_optimization"]["offload_optimizer"]["pin_memory"] = pin
            engine = make_engine(tensors, config=config)
            waits[tensors] = []
            for micro in range(2 * GRAD_ACCUM):
                loss = engine(batch(engine, 3000 + micro))
                with count_host_syncs(kinds=(EVENT_WAIT, )) as counted:
                    engine.backward(loss)
                waits[tensors].append(counted.total)
                with count_host_syncs(kinds=(EVENT_WAIT, )):  # step()'s wait seen, so the next count starts clean
                    optimizer_step(engine)
        name = "pinned" if pin else "pageable"
        found[f"{name}_at_most_{int(not pin)}"] = all(count <= int(not pin) for count in waits[8] + waits[24])
        found[f"{name}_same_at_8_and_24"] = waits[8] == waits[24]
    return found


def _learns_like_pytorch(cell_options: Dict[str, Any]):
    """A check that trains one oracle cell (ZeRO-2, fp32, this rank alone) and compares every step's gradient norm and
    the parameters with the same job in plain PyTorch, to a tolerance that a GPU's own rounding stays within and a
    dropped micro-batch does not (it changes the norm by a third or more)."""

    def check(precision: str) -> Dict[str, bool]:
        from deepspeed_offload_patch.testing import oracle

        cell = oracle.Cell(stage=2, **cell_options)
        problems = oracle.compare(cell, oracle.train(cell), oracle.reference(cell, 1), tolerance=VERIFY_TOLERANCE)
        return {
            "norms_match": not any("norm" in p for p in problems),
            "params_match": not any("param" in p for p in problems)
        }

    return check


#: (absolute, relative) tolerance of the oracle checks: a GPU's fp32 sums differ from the CPU's in the last bits.
VERIFY_TOLERANCE = (1e-4, 1e-3)

#: The checks a change can name in its record's ``verify_checks``: the function run in the rank (given the
#: precision; it returns ``{finding: bool}``, all true when it passes), what it proves, and what its failure shows.
CHECKS = {
    "step-after-a-skip":
    (_step_after_a_skip, "with fp32 gradient accumulation, the step after a skipped one updates the parameters",
     "with fp32 gradient accumulation, the step after a skipped one did not update the parameters"),
    "every-micro-batch":
    (_learns_like_pytorch(dict(grad_accum=3)),
     "with gradient_accumulation_steps 3, each step trains on all 3 micro-batches, as plain PyTorch does",
     "with gradient_accumulation_steps 3, the steps did not train on what plain PyTorch trains on"),
    "check-left-out":
    (_check_left_out, "a bf16 config that leaves out check_grad_overflow skips a step with a NaN gradient",
     "a bf16 config that leaves out check_grad_overflow applied a step with a NaN gradient"),
    "waits-per-backward":
    (_waits_per_backward, "with gradient accumulation, a ZeRO-2 backward makes at most one host event wait (pageable "
     "buffers) or none (pinned), at 8 and 24 tensors alike",
     "with gradient accumulation, a ZeRO-2 backward waited on the host more than once, or more with more tensors"),
    "every-backward":
    (_learns_like_pytorch(dict(backwards=2)),
     "with 2 backwards per step (set_gradient_accumulation_boundary), each step trains on both, as plain PyTorch does",
     "with 2 backwards per step, the steps did not train on what plain PyTorch trains on"),
}


def verify(steps: int = 3) -> int:
    """Run the check and print one line per finding. Returns the process exit code (0 pass, 1 fail)."""
    from deepspeed_offload_patch.testing.launch import HANG_GUARD_S, DistributedFailure, run_distributed

    try:
        report = run_distributed(_verify_rank, world_size=1, args=(steps, ), timeout=HANG_GUARD_S)[0]
    except DistributedFailure as exc:
        print(f"verify: FAIL: the check could not run:\n{exc}")
        return 1
    print(
        f"verify: ZeRO-2, optimizer offloaded to the CPU, {report['precision']}, on {report['device']}; patch state: "
        f"{report['state']}")
    if report["sync"] is not None:
        print(f"verify: FAIL: the boundary backward synchronized with the host: {report['sync']}")
        return 1
    print(f"verify: ok: {steps} boundary backward passes without a host sync")
    if not (report["nan_skipped"] and report["unchanged"]):
        print(f"verify: FAIL: a NaN gradient did not skip the step (skipped: {report['nan_skipped']}, parameters "
              f"unchanged: {report['unchanged']})")
        return 1
    print("verify: ok: a NaN gradient skips the step and leaves the parameters unchanged")
    for label, state in report["unchecked"]:
        print(f"verify: the {label} is {state}: nothing more to check")
    for check, (label, state, found) in report["checks"].items():
        if not all(found.values()):
            print(f"verify: FAIL: {CHECKS[check][2]} ({label} {state}; {found})")
            return 1
        print(f"verify: ok: {CHECKS[check][1]}")
    return 0
