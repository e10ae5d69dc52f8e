# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""What the installed DeepSpeed does that a check must adapt to: which tracker it has, and in which precision
``step()`` reads the offload overflow flag.

Small on purpose: ``ds-offload-patch verify`` needs these and nothing of the equivalence harness
(:mod:`deepspeed_offload_patch.testing.equivalence`, which re-exports them). Each imports DeepSpeed's ZeRO module.
"""


def per_param_tracker() -> bool:
    """Whether the installed DeepSpeed has the tracker of 0.14.0 to 0.17.0,
    ``update_overflow_tracker_for_param_grad(param)`` (patched or not)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from deepspeed_offload_patch.changes import UPSTREAM

    return UPSTREAM.form_for(DeepSpeedZeroOptimizer) is UPSTREAM.forms[0]


def flag_is_read(precision: str) -> bool:
    """Whether ``step()`` of the installed DeepSpeed reads the offload overflow flag in ``precision`` (as
    :class:`~deepspeed_offload_patch.testing.equivalence.Run` names it): fp16 always; bf16 with the check on from
    0.17.1 (before, ``step()`` checks overflow in fp16 only); bf16 with the check off and fp32 never. Where it is not
    read, the patched tracker checks nothing."""
    if precision == "fp16":
        return True
    return precision == "bf16" and not per_param_tracker()


def has_defect(name: str) -> bool:
    """Whether the installed DeepSpeed's own code has the defect that the change called ``name`` fixes: its guard
    applies it to DeepSpeed's class (or has, in this process). Raises LookupError for a name no change has."""
    import importlib

    import deepspeed

    from deepspeed_offload_patch.changes import by_name
    from deepspeed_offload_patch.patch_status import deepspeed_lacks
    from deepspeed_offload_patch.states import State

    change = by_name(name)
    if change.target.optional and deepspeed_lacks(change.target.module):
        return False  # a release without the module the change is about
    cls = getattr(importlib.import_module(change.target.module), change.target.name)
    return change.decide(change, cls, deepspeed.__version__).state == State.APPLIED
