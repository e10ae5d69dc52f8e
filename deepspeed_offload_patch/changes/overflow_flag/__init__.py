# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The overflow flag fix (DeepSpeed pull request 8963), the upstream change: its record.

The offload tracker put the device result of the inf/NaN check into a Python ``if``, one host synchronization per
partition gradient at every accumulation boundary; ``has_overflow()`` then wrapped the host bool in a new tensor. The
replacements (:mod:`.methods`) keep the flag on the device and read it once, after the all-reduce.
"""

from deepspeed_offload_patch.changes.overflow_flag.probe import probe_tracker
from deepspeed_offload_patch.changes.record import Change, Form
from deepspeed_offload_patch.guard import decide_by_methods
from deepspeed_offload_patch.states import GOOD_STATES
from deepspeed_offload_patch.waits import READ


def _methods():
    from deepspeed_offload_patch.changes.overflow_flag import methods
    return methods


CHANGE = Change(
    name="overflow-flag",
    title="the overflow flag fix",
    label="the overflow flag fix",
    forms=(
        # The tracker takes the parameter, and step() reads the flag in fp16 only.
        Form(("update_overflow_tracker_for_param_grad", "has_overflow"),
             tracker="update_overflow_tracker_for_param_grad",
             first_release="0.14.0",
             until="0.17.1",
             functions=(("update_overflow_tracker_for_param_grad", "update_overflow_tracker_for_param_grad"),
                        ("has_overflow", "has_overflow_serial_if_not_partitioned"))),
        # The tracker takes the gradient; has_overflow all-reduces over data parallel ranks only when partitioned.
        Form(("update_offload_overflow_tracker", "has_overflow"),
             tracker="update_offload_overflow_tracker",
             first_release="0.17.1",
             until="0.18.0",
             functions=(("update_offload_overflow_tracker", "update_offload_overflow_tracker"),
                        ("has_overflow", "has_overflow_dp_if_partitioned"))),
        Form(("update_offload_overflow_tracker", "has_overflow"),
             tracker="update_offload_overflow_tracker",
             first_release="0.18.0",
             functions=(("update_offload_overflow_tracker", "update_offload_overflow_tracker"), ("has_overflow",
                                                                                                 "has_overflow"))),
    ),
    methods=_methods,
    decide=decide_by_methods,
    probe=probe_tracker,
    good_states=GOOD_STATES,
    state_key="state",
    reason_key="reason",
    about="the boundary backward keeps the overflow flag on the device and checks nothing when nothing reads the "
    "flag; has_overflow() reads it once, after its all-reduce. What the package applies by default, and what DeepSpeed "
    "pull request 8963 makes upstream.",
    upstream=True,
    wait=READ,
    defect=("host-sync", "a host sync per gradient in each boundary backward"),
)
