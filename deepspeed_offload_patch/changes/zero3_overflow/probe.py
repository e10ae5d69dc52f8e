# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The ZeRO-3 overflow fix's behavioural probe: does a ZeRO-3 class in no known form skip an offloaded bf16 step whose
gradient norm is invalid?"""

from types import SimpleNamespace
from typing import Optional

#: The method the fix replaces (the probe runs ``step``, which calls it).
METHOD = "_overflow_check_and_loss_scale_update"


class _Applied(Exception):
    """Raised by the stubbed optimizer step: the probed ``step`` went on to update the parameters."""


def probe_skip(cls: type) -> Optional[str]:
    """Run ``cls.step`` on a bare instance (built without ``__init__``) of an offloaded bf16 ZeRO-3 optimizer whose
    gradient holds an inf: its overflow check finds it when called, and its only gradient group has the norm DeepSpeed
    gives such a gradient (-1); the collaborators ``step`` reaches are stubbed. None when the step is skipped down the
    overflow path (the gradients cleared, no optimizer step), whichever of the two found it; else what it did. Any
    exception counts as not fixed. Only code that matches no known form is probed."""
    import torch

    if "step" not in cls.__dict__:
        return "has no step"
    optimizer = cls.__new__(cls)
    cleared = []

    def applied(*args, **kwargs):
        raise _Applied()

    stubs = dict(
        dtype=torch.bfloat16,
        offload_optimizer=True,
        overflow=False,
        swap_optimizer=False,
        custom_loss_scaler=False,
        loss_scale=1.0,  # read through the loss scaler where it is a property, as itself where it is not
        loss_scaler=SimpleNamespace(cur_scale=1.0, loss_scale=1.0, dynamic=False, update_scale=lambda overflow: None),
        check_overflow=lambda *args, **kwargs: setattr(optimizer, "overflow", True),
        _pre_step=lambda: None,
        _partition_all_parameters=lambda: None,
        _apply_muon_to_accumulated_grads=lambda: None,
        _get_norm_groups=lambda: [torch.tensor(-1.0)],
        _update_scale=lambda overflow: None,
        _overflow_clean_up=lambda prev_scale: cleared.append(prev_scale),
        _loco_err_buf_update=lambda overflow, scale=1.0: None,
        _prepare_sub_group=applied,
        unscale_and_clip_grads=applied,
        _optimizer_step=applied,
        timers=applied,
    )
    try:
        vars(optimizer).update(stubs)
        cls.step(optimizer)
    except _Applied:
        return "applies an offloaded bf16 step whose gradient norm is invalid (an inf/NaN)"
    except Exception as exc:  # unknown code: whatever it does wrong, it is not the fixed form
        return f"raised {type(exc).__name__}: {exc}"
    if not cleared:
        return "returned from step() without clearing the gradients of an invalid step"
    return None
