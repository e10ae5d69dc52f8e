# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The invalid-norm fix: its record.

With ``offload_optimizer``, a ZeRO-1/2 step that DeepSpeed 0.14.0 - 0.19.7 do not check for inf/NaN (fp32; bf16
before 0.17.1) meets the -1 that DeepSpeed gives an inf/NaN gradient norm: 0.14.0 - 0.17.0 crash in ``step()`` (an
integer -1), 0.17.1 - 0.19.7 apply the step and the fp32 master weights turn NaN (a float -1 that the L2 norm makes
1.0). One defect in DeepSpeed's two return types, so one change in two forms (:mod:`.methods`): the step's norm is
computed before its overflow branch and an invalid one skips the step, as 0.19.8 does. On by default where DeepSpeed
has the defect; ``not-needed`` from 0.19.8; not part of DeepSpeed pull request 8963.
"""

from deepspeed_offload_patch import guard
from deepspeed_offload_patch.changes.invalid_norm.probe import TRACKER, probe_skip
from deepspeed_offload_patch.changes.record import Change, Form
from deepspeed_offload_patch.states import State

_SCALE = "_update_scale"


def _methods():
    from deepspeed_offload_patch.changes.invalid_norm import methods
    return methods


def decide(change: Change, cls: type, version: str) -> guard.Decision:
    """``applied`` where ``scaled_global_norm`` and ``_update_scale`` are a known defective form; ``not-needed`` where
    ``scaled_global_norm`` is in no known form but the class skips an offloaded fp32 step with an invalid gradient
    norm (:func:`probe_skip`: DeepSpeed from 0.19.8)."""
    return guard.decide_where_defective(change, cls, version, "a step with an invalid gradient norm is skipped")


def affects(job) -> tuple:
    """Whether an offloaded ZeRO-1/2 ``job`` (:class:`deepspeed_offload_patch.affected.Job`) meets an inf/NaN that no
    check looked at: in fp32 always; in bf16 before DeepSpeed 0.17.1 (no check to turn on), and from 0.17.1 with
    ``check_grad_overflow`` false, which this fix leaves alone (the user's opt-out, as 0.19.8); fp16 checks every
    step."""
    if job.precision == "fp16":
        return "no", "fp16 checks every step for an inf/NaN"
    if job.precision == "fp32":
        return "yes", "fp32 steps are not checked: one inf/NaN crashes step() or turns the master weights into NaN"
    if job.check_grad_overflow is False:
        return "maybe", ("bf16 with check_grad_overflow false: before DeepSpeed 0.17.1 (no such check) one inf/NaN "
                         "crashes step(); from 0.17.1 it turns the master weights into NaN, and this fix leaves "
                         "that opt-out as DeepSpeed 0.19.8 does")
    return "maybe", "bf16 before DeepSpeed 0.17.1 has no overflow check: one inf/NaN crashes step()"


CHANGE = Change(
    name="invalid-norm",
    title="the invalid-norm fix",
    label="invalid-norm fix",
    forms=(
        # The offload group norm is a Python number: the integer -1 of an inf/NaN crashes the L2 norm (torch.norm)...
        Form((TRACKER, _SCALE),
             tracker=TRACKER,
             first_release="0.14.0",
             until="0.16.3",
             functions=((TRACKER, "scaled_global_norm_of_numbers_torch_norm"), (_SCALE, "_update_scale"))),
        # ... or vector_norm.
        Form((TRACKER, _SCALE),
             tracker=TRACKER,
             first_release="0.16.3",
             until="0.17.1",
             functions=((TRACKER, "scaled_global_norm_of_numbers"), (_SCALE, "_update_scale"))),
        # The offload group norm is a float tensor: -1.0 becomes the norm 1.0 and the step is applied.
        Form((TRACKER, _SCALE),
             tracker=TRACKER,
             first_release="0.17.1",
             until="0.19.8",
             functions=((TRACKER, "scaled_global_norm"), (_SCALE, "_update_scale"))),
    ),
    methods=_methods,
    decide=decide,
    probe=probe_skip,
    # In effect, not needed (the release skips such a step), or switched off by the user's choice.
    good_states=(State.APPLIED, State.UPSTREAM_FIXED, State.NOT_NEEDED, State.OFF),
    about="with offload_optimizer, a ZeRO-1/2 step that no overflow check looked at (fp32; bf16 before 0.17.1) is "
    "skipped when its gradient norm is invalid (an inf/NaN), instead of crashing step() (DeepSpeed 0.14.0 - 0.17.0) "
    "or turning the fp32 master weights into NaN (0.17.1 - 0.19.7); fixed upstream in 0.19.8.",
    state_key="invalid_norm",
    reason_key="invalid_norm_reason",
    diff_help="the invalid-norm fix's diff instead (DeepSpeed 0.14.0 - 0.19.7: an offloaded ZeRO-1/2 step with an "
    "invalid gradient norm is skipped)",
    defect=("invalid-norm", "one inf/NaN gradient crashes ZeRO-1/2's step() or turns its master weights into NaN"),
    affects=affects,
    # Patched, such a step is skipped where DeepSpeed applies it: the harness's reference installs this change.
    corrects_training=True,
)
