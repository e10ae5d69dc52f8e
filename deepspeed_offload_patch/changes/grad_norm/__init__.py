# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The on-device gradient norm: its record.

``step()`` read each owned parameter's gradient norm with ``.item()`` to sum the squares in a Python float, the
overflow check's defect in the step instead of the backward. The replacement (:mod:`.methods`) sums on the device, to
the same bits. On by default; not part of DeepSpeed pull request 8963.
"""

from deepspeed_offload_patch.changes.record import Change, Form
from deepspeed_offload_patch.guard import decide_by_methods
from deepspeed_offload_patch.states import State
from deepspeed_offload_patch.waits import READ

_METHOD = "complete_grad_norm_calculation_for_cpu_offload"


def _methods():
    from deepspeed_offload_patch.changes.grad_norm import methods
    return methods


CHANGE = Change(
    name="grad-norm",
    title="the on-device grad norm",
    label="on-device grad norm",
    forms=(
        # The norm goes back as a Python number (-1 for inf/NaN).
        Form((_METHOD, ),
             tracker=_METHOD,
             first_release="0.14.0",
             until="0.17.1",
             functions=((_METHOD, "complete_grad_norm_returning_a_number"), )),
        # The norm goes back as a float32 tensor.
        Form((_METHOD, ),
             tracker=_METHOD,
             first_release="0.17.1",
             functions=((_METHOD, "complete_grad_norm_calculation_for_cpu_offload"), )),
    ),
    methods=_methods,
    decide=decide_by_methods,
    # In effect, or switched off by the user's choice.
    good_states=(State.APPLIED, State.UPSTREAM_FIXED, State.OFF),
    about="step() sums the gradient norms on the device instead of reading one per parameter tensor.",
    state_key="grad_norm_on_device",
    reason_key="grad_norm_reason",
    diff_help="the on-device gradient norm's diff instead",
    wait=READ,
    defect=("step-reads", "step() reads one host value per gradient tensor"),
)
