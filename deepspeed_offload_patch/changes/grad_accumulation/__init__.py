# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The gradient-accumulation fix: its record.

ZeRO-2 with ``offload_optimizer`` and ``gradient_accumulation_steps`` of 3 or more trains, on DeepSpeed 0.15.2 -
0.18.x, on the first and the last micro-batch of each step only: the running sum goes to the CPU buffer at micro-step 0
alone (:mod:`.methods`). The replacement stores it at every micro-step that another follows. On by default where
DeepSpeed has the defect; ``not-needed`` before 0.15.2 and from 0.19.0, whose code keeps every micro-step; not part
of DeepSpeed pull request 8963.
"""

from deepspeed_offload_patch import guard
from deepspeed_offload_patch.changes.grad_accumulation.probe import METHOD, probe_accumulation
from deepspeed_offload_patch.changes.record import Change, Form
from deepspeed_offload_patch.states import State


def _methods():
    from deepspeed_offload_patch.changes.grad_accumulation import methods
    return methods


def decide(change: Change, cls: type, version: str) -> guard.Decision:
    """``applied`` where the accumulation method is a known defective form; ``not-needed`` where it is in no known
    form but keeps every micro-step (:func:`probe_accumulation`: DeepSpeed before 0.15.2 and from 0.19.0)."""
    return guard.decide_where_defective(change, cls, version, "every micro-step's gradient reaches the step")


def affects(job) -> tuple:
    """Whether an offloaded ZeRO-1/2 ``job`` (:class:`deepspeed_offload_patch.affected.Job`) accumulates through the
    CPU buffer over 3 or more micro-steps: ZeRO-2 (ZeRO-1 reduces once, at the boundary) and
    ``gradient_accumulation_steps`` of 3 or more."""
    if job.stage not in (2, "auto"):
        return "no", "ZeRO-1 reduces the accumulated gradient once, at the boundary"
    if job.grad_accum == "auto":
        return "maybe", "gradient_accumulation_steps auto (3 or more drops micro-batches)"
    if not isinstance(job.grad_accum, int) or job.grad_accum < 3:
        return "no", f"gradient_accumulation_steps {job.grad_accum}: no micro-step lies between the first and the last"
    maybe = "maybe" if job.stage == "auto" else "yes"
    return maybe, (f"gradient_accumulation_steps {job.grad_accum}: micro-steps 1 - {job.grad_accum - 2} of each step "
                   "are dropped")


CHANGE = Change(
    name="grad-accumulation",
    title="the gradient-accumulation fix",
    label="gradient-accumulation fix",
    forms=(
        # The low-precision master option is fp16_master_weights_and_gradients.
        Form((METHOD, ),
             tracker=METHOD,
             first_release="0.15.2",
             until="0.18.3",
             functions=((METHOD, "async_accumulate_grad_in_cpu_via_gpu_fp16_master"), )),
        # ... and low_precision_master_weights_and_grads.
        Form((METHOD, ),
             tracker=METHOD,
             first_release="0.18.3",
             until="0.19.0",
             functions=((METHOD, "async_accumulate_grad_in_cpu_via_gpu"), )),
    ),
    methods=_methods,
    decide=decide,
    probe=probe_accumulation,
    # In effect, not needed (the release keeps every micro-step), or switched off by the user's choice.
    good_states=(State.APPLIED, State.UPSTREAM_FIXED, State.NOT_NEEDED, State.OFF),
    about="with gradient accumulation over 3 or more micro-steps, ZeRO-2 offload stores the running gradient sum at "
    "every micro-step that another follows, instead of at micro-step 0 only, which drops the micro-batches between "
    "the first and the last (DeepSpeed 0.15.2 - 0.18.x; fixed upstream in 0.19.0).",
    state_key="grad_accumulation",
    reason_key="grad_accumulation_reason",
    diff_help="the gradient-accumulation fix's diff instead (DeepSpeed 0.15.2 - 0.18.x: every micro-step of "
    "gradient_accumulation_steps >= 3 reaches the step)",
    defect=("dropped-micro-batches", "gradient accumulation over 3+ micro-steps drops all but the first and last"),
    affects=affects,
    corrects_training=True,
    verify_checks=("every-micro-batch", ),
)
