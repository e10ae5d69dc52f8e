# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The ZeRO-3 overflow fix: its record.

With ``offload_optimizer``, ZeRO-3 on DeepSpeed 0.14.0 - 0.19.7 applies a bf16 or fp32 step whose gradient holds an
inf/NaN, and the fp32 master weights turn NaN (:mod:`.methods`). The replacement of
``_overflow_check_and_loss_scale_update`` runs the overflow check fp16 runs in every precision of an offloaded job, so
that step is skipped the way DeepSpeed skips an fp16 overflow. On by default where DeepSpeed has the defect;
``not-needed`` from 0.19.8, whose step skips it by the gradient norm; not part of DeepSpeed pull request 8963.
"""

from deepspeed_offload_patch import guard
from deepspeed_offload_patch.changes.record import ZERO_3, Change, Form
from deepspeed_offload_patch.changes.zero3_overflow.probe import METHOD, probe_skip
from deepspeed_offload_patch.states import State


def _methods():
    from deepspeed_offload_patch.changes.zero3_overflow import methods
    return methods


def decide(change: Change, cls: type, version: str) -> guard.Decision:
    """``applied`` where ``_overflow_check_and_loss_scale_update`` is a known defective form; ``not-needed`` where it
    is in no known form but the class skips an offloaded bf16 step with an invalid gradient norm
    (:func:`probe_skip`: DeepSpeed from 0.19.8)."""
    return guard.decide_where_defective(change, cls, version, "a step with an inf/NaN gradient is skipped")


def affects(job) -> tuple:
    """Whether an offloaded ZeRO-3 ``job`` (:class:`deepspeed_offload_patch.affected.Job`) can apply a step with an
    inf/NaN gradient: in bf16 and fp32 (fp16 checks every step), whatever bf16's ``check_grad_overflow`` says (ZeRO-3
    never reads it)."""
    if job.precision == "fp16":
        return "no", "fp16 checks every step for an inf/NaN"
    if job.precision == "auto":
        return "maybe", "in bf16 or fp32, one inf/NaN gradient turns the fp32 master weights into NaN"
    return "yes", f"in {job.precision}, one inf/NaN gradient turns the fp32 master weights into NaN"


CHANGE = Change(
    name="zero3-overflow",
    title="the ZeRO-3 overflow fix",
    label="ZeRO-3 overflow fix",
    target=ZERO_3,
    forms=(
        Form((METHOD, ),
             tracker=METHOD,
             first_release="0.14.0",
             until="0.16.2",
             functions=((METHOD, "overflow_check_and_loss_scale_update"), )),
        # ... and with ZeRO++'s LoCo error buffers.
        Form((METHOD, ),
             tracker=METHOD,
             first_release="0.16.2",
             until="0.19.8",
             functions=((METHOD, "overflow_check_with_loco_update"), )),
    ),
    methods=_methods,
    decide=decide,
    probe=probe_skip,
    # In effect, not needed (the release skips such a step), or switched off by the user's choice.
    good_states=(State.APPLIED, State.UPSTREAM_FIXED, State.NOT_NEEDED, State.OFF),
    about="ZeRO-3 with offload_optimizer checks a bf16 or fp32 step's gradients for inf/NaN, as it does in fp16, and "
    "skips a step that has one instead of turning the fp32 master weights into NaN (DeepSpeed 0.14.0 - 0.19.7; fixed "
    "upstream in 0.19.8).",
    state_key="zero3_overflow",
    reason_key="zero3_overflow_reason",
    diff_help="the ZeRO-3 overflow fix's diff instead (DeepSpeed 0.14.0 - 0.19.7: an offloaded bf16/fp32 ZeRO-3 step "
    "with an inf/NaN gradient is skipped)",
    defect=("zero3-nan-weights", "one inf/NaN gradient turns ZeRO-3's master weights into NaN"),
    affects=affects,
)
