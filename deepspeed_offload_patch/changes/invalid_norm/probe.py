# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The invalid-norm fix's behavioural probe: does a ZeRO-1/2 class in no known form skip an offloaded fp32 step whose
gradient norm is invalid?"""

from types import SimpleNamespace
from typing import Optional

#: The method whose form tells the releases apart (the probe runs ``step``, which reaches it).
TRACKER = "scaled_global_norm"


class _Applied(Exception):
    """Raised by the stubbed clip or optimizer step: the probed ``step`` went on to update the parameters."""


class _Groups:
    """The data parallel groups: the step's optimizer loop indexes them first, so reaching them is applying the step."""

    def __getitem__(self, index):
        raise _Applied()


class _Timer:

    def start(self):
        pass

    def stop(self):
        pass


def probe_skip(cls: type) -> Optional[str]:
    """Run ``cls.step`` on a bare instance (built without ``__init__``) of an offloaded fp32 ZeRO-1/2 optimizer with
    one gradient group whose offload norm is DeepSpeed's -1 for an inf/NaN, the class's own ``step``,
    ``scaled_global_norm`` and ``_update_scale`` running, their collaborators stubbed. None when the step is skipped
    down the overflow path (``self.overflow`` set, the CPU buffers reset, nothing clipped or stepped); else what it
    did. Any exception counts as not fixed. Only code that matches no known form is probed."""
    import torch

    if "step" not in cls.__dict__:
        return "has no step"
    optimizer = cls.__new__(cls)
    reset = []

    def applied(*args, **kwargs):
        raise _Applied()

    stubs = dict(
        dtype=torch.float32,
        device="cpu",
        cpu_offload=True,
        compute_grad_norm=True,
        check_grad_overflow=False,
        partition_gradients=True,
        overflow=False,
        micro_step_id=0,
        has_moe_layers=False,
        custom_loss_scaler=False,
        external_loss_scale=None,
        loss_scaler=SimpleNamespace(cur_scale=1.0, loss_scale=1.0, dynamic=False, update_scale=lambda overflow: None),
        bit16_groups=[[]],
        params_in_partition=[[]],
        averaged_gradients={0: None},
        all_grad_tensors={0: None},
        _global_grad_norm=None,
        _offload_accumulated_param_ids=set(),
        _muon_pending_momentum={},
        complete_grad_norm_calculation_for_cpu_offload=lambda params: torch.tensor(-1.0),
        check_overflow=lambda *args, **kwargs: None,
        _wait_for_offload_copies=lambda: None,
        _apply_muon_updates_cpu_offload=lambda: None,
        _muon_update_lacks_loss_scale=lambda group: False,
        _commit_muon_momentum=lambda: None,
        _release_preflattened_grad_buffers=lambda: None,
        zero_grad=lambda set_to_none=True: None,
        reset_cpu_buffers=lambda: reset.append(True),
        timers=lambda name: _Timer(),
        real_dp_process_group=_Groups(),
        unscale_and_clip_grads=applied,
        _optimizer_step=applied,
    )
    try:
        vars(optimizer).update(stubs)
        cls.step(optimizer)
    except _Applied:
        return "applies an offloaded fp32 step whose gradient norm is invalid (an inf/NaN)"
    except Exception as exc:  # unknown code: whatever it does wrong, it is not the fixed form
        return f"raised {type(exc).__name__}: {exc}"
    if not (optimizer.overflow and reset):
        return "returned from step() without taking the overflow path for an invalid gradient norm"
    return None
