# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The event-wait fix: its record.

On DeepSpeed 0.19.8, ZeRO-2 with ``offload_optimizer`` and gradient accumulation (or several backwards per step)
makes the host wait on an event before each parameter tensor of every backward, and once per tensor when it restores
the accumulated gradients at the boundary (:mod:`.methods`): on a GPU, a stall per tensor. The replacement keeps the
ordering on the device where the CPU buffers are pinned, and waits once per backward where they are not. ZeRO-1 and
a lone backward per step make no such wait. Opt-in (``DS_OFFLOAD_PATCH_EVENT_WAITS=1``) until a GPU has shown it
bit-identical with the waits constant in the number of tensors; ``not-needed`` before 0.19.8, whose code has no such
wait; not part of DeepSpeed pull request 8963.
"""

from deepspeed_offload_patch import guard
from deepspeed_offload_patch.changes.event_waits.probe import METHOD, probe_waits
from deepspeed_offload_patch.changes.record import Change, Form
from deepspeed_offload_patch.states import State
from deepspeed_offload_patch.waits import EVENT_WAIT

RESTORE = "_restore_cpu_offload_grad_to_gpu"


def _methods():
    from deepspeed_offload_patch.changes.event_waits import methods
    return methods


def decide(change: Change, cls: type, version: str) -> guard.Decision:
    """``applied`` where the accumulation method is a known form that waits per tensor; ``not-needed`` where it is in
    no known form but makes at most one host wait per backward (:func:`probe_waits`: DeepSpeed before 0.19.8)."""
    return guard.decide_where_defective(change, cls, version, "the host does not wait per tensor in a backward")


def affects(job) -> tuple:
    """Whether an offloaded ZeRO-1/2 ``job`` (:class:`deepspeed_offload_patch.affected.Job`) goes through the
    per-tensor waits: ZeRO-2 with ``gradient_accumulation_steps`` 2 or more (or several backwards per step, which the
    config cannot tell). The waits cost time on a GPU only."""
    if job.stage not in (2, "auto"):
        return "no", "ZeRO-1 reduces once, at the boundary, without the CPU accumulation buffer"
    if job.grad_accum == "auto":
        return "maybe", "gradient_accumulation_steps auto (2 or more waits per tensor on a GPU)"
    if isinstance(job.grad_accum, int) and job.grad_accum >= 2:
        maybe = "maybe" if job.stage == "auto" else "yes"
        return maybe, f"gradient_accumulation_steps {job.grad_accum}"
    return "maybe", "only if a step takes several backward() calls (set_gradient_accumulation_boundary)"


CHANGE = Change(
    name="event-waits",
    title="the event-wait fix",
    label="event-wait fix",
    forms=(Form((METHOD, RESTORE),
                tracker=METHOD,
                first_release="0.19.8",
                functions=((METHOD, METHOD), (RESTORE, RESTORE)),
                witnesses=("_wait_for_offload_copies", "_record_offload_copy")), ),
    methods=_methods,
    decide=decide,
    probe=probe_waits,
    # In effect, not needed (no per-tensor wait in the release), or off (opt-in, or the user's choice).
    good_states=(State.APPLIED, State.UPSTREAM_FIXED, State.NOT_NEEDED, State.OFF),
    about="with gradient accumulation (or several backwards per step), ZeRO-2 offload orders the copies through the "
    "CPU accumulation buffer on the device where the buffer is pinned, and with one host wait per backward where it is "
    "not, instead of a host wait (Event.synchronize) per parameter tensor in every backward (DeepSpeed 0.19.8). The "
    "same copies in the same order: the same bits.",
    state_key="event_waits",
    reason_key="event_waits_reason",
    diff_help="the event-wait fix's diff instead (DeepSpeed 0.19.8: no host wait per tensor in a ZeRO-2 offload "
    "backward with gradient accumulation)",
    wait=EVENT_WAIT,
    defect=("per-tensor-waits", "on a GPU the host waits once per parameter tensor in every backward"),
    affects=affects,
    verify_checks=("waits-per-backward", ),
    opt_in="not yet proven on a GPU",
)
