# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The several-backwards fix: its record.

With ``gradient_accumulation_steps: 1``, a step of several ``backward()`` calls (each but the last outside the
boundary, through ``engine.set_gradient_accumulation_boundary``, as Accelerate does) trains, with ZeRO-2 and
``offload_optimizer`` up to DeepSpeed 0.18.x, on its last backward alone (:mod:`.methods`; ZeRO-1 reduces once, at the
boundary). The replacement keeps every backward's gradient through the CPU accumulation buffer. On by default where DeepSpeed has the defect; ``not-needed``
from 0.19.0; not part of DeepSpeed pull request 8963.
"""

from deepspeed_offload_patch import guard
from deepspeed_offload_patch.changes.record import Change, Form
from deepspeed_offload_patch.changes.several_backwards.probe import METHOD, probe_backwards
from deepspeed_offload_patch.states import State


def _methods():
    from deepspeed_offload_patch.changes.several_backwards import methods
    return methods


def decide(change: Change, cls: type, version: str) -> guard.Decision:
    """``applied`` where ``copy_grads_in_partition`` is a known defective form; ``not-needed`` where it is in no
    known form but keeps every backward of a step (:func:`probe_backwards`: DeepSpeed from 0.19.0)."""
    return guard.decide_where_defective(change, cls, version, "every backward of a step reaches it")


def affects(job) -> tuple:
    """Whether an offloaded ZeRO-1/2 ``job`` (:class:`deepspeed_offload_patch.affected.Job`) can lose backwards: ZeRO-2
    with ``gradient_accumulation_steps`` 1, if its script calls ``backward()`` several times per step (the config
    cannot tell; ZeRO-1 reduces the summed gradient once, at the boundary)."""
    if job.stage not in (2, "auto"):
        return "no", "ZeRO-1 reduces the summed gradient once, at the boundary"
    if job.grad_accum not in (1, "auto"):
        return "no", f"gradient_accumulation_steps {job.grad_accum} keeps every backward"
    return "maybe", ("if a step takes several backward() calls (set_gradient_accumulation_boundary, as Accelerate "
                     "does), only the last counts")


CHANGE = Change(
    name="several-backwards",
    title="the several-backwards fix",
    label="several-backwards fix",
    forms=(
        # The boundary calls update_overflow_tracker_for_param_grad.
        Form((METHOD, ),
             tracker=METHOD,
             first_release="0.14.0",
             until="0.17.1",
             functions=((METHOD, "copy_grads_in_partition_param_tracker"), )),
        # ... and update_offload_overflow_tracker_for_param_grad.
        Form((METHOD, ),
             tracker=METHOD,
             first_release="0.17.1",
             until="0.19.0",
             functions=((METHOD, "copy_grads_in_partition"), )),
    ),
    methods=_methods,
    decide=decide,
    probe=probe_backwards,
    # In effect, not needed (the release keeps every backward), or switched off by the user's choice.
    good_states=(State.APPLIED, State.UPSTREAM_FIXED, State.NOT_NEEDED, State.OFF),
    about="with gradient_accumulation_steps 1, every backward() of a step through set_gradient_accumulation_boundary "
    "reaches the step through the CPU accumulation buffer, instead of the last one alone (DeepSpeed up to 0.18.x; "
    "fixed upstream in 0.19.0).",
    state_key="several_backwards",
    reason_key="several_backwards_reason",
    diff_help="the several-backwards fix's diff instead (DeepSpeed up to 0.18.x: every backward() of a step counts "
    "with gradient_accumulation_steps 1)",
    defect=("dropped-backwards", "several backward() per step keep only the last"),
    affects=affects,
    corrects_training=True,
    verify_checks=("every-backward", ),
)
