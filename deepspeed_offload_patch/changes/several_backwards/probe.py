# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The several-backwards fix's behavioural probe: does a ``copy_grads_in_partition`` in no known form keep the
gradients of every backward of a step with ``gradient_accumulation_steps: 1``?"""

from typing import Optional

#: The method the probe runs.
METHOD = "copy_grads_in_partition"


class _Boundary:
    """``is_gradient_accumulation_boundary`` as an attribute (up to DeepSpeed 0.19.7) and as a method (0.19.8)."""

    def __init__(self, value: bool):
        self.value = value

    def __bool__(self) -> bool:
        return self.value

    def __call__(self) -> bool:
        return self.value


def probe_backwards(cls: type) -> Optional[str]:
    """Run ``cls.copy_grads_in_partition`` for one parameter over a step of two backwards (the second at the boundary)
    with ``gradient_accumulation_steps: 1`` and the optimizer offloaded, on a bare instance (built without
    ``__init__``) whose collaborators are stubbed; None when both backwards go through the CPU accumulation method
    (the first to store its gradient, the second to add it back), else what it did. Any exception counts as not
    fixed. Only code that matches no known form is probed."""
    import torch

    method = cls.__dict__.get(METHOD)
    if method is None:
        return f"has no {METHOD}"
    stored = []
    optimizer = cls.__new__(cls)

    def accumulate(param):
        stored.append(optimizer.micro_step_id)
        optimizer.accumulated_grads_in_cpu.setdefault(0, torch.zeros(1))

    try:
        vars(optimizer).update(cpu_offload=True,
                               gradient_accumulation_steps=1,
                               accumulated_grads_in_cpu={},
                               use_grad_accum_attribute=False,
                               _offload_accumulated_param_ids=set(),
                               get_param_id=lambda param: 0,
                               _get_param_group_idx=lambda param: 0,
                               _use_compact_grad_partition_buffer=lambda group_idx: False,
                               async_accumulate_grad_in_cpu_via_gpu=accumulate,
                               set_norm_for_param_grad_in_gpu=lambda param: None,
                               update_overflow_tracker_for_param_grad=lambda param: None,
                               update_offload_overflow_tracker_for_param_grad=lambda param: None,
                               async_inplace_copy_grad_to_fp32_buffer_from_gpu=lambda param: None)
        for micro in range(2):
            vars(optimizer).update(micro_step_id=micro, is_gradient_accumulation_boundary=_Boundary(micro == 1))
            method(optimizer, torch.zeros(1))
    except Exception as exc:  # unknown code: whatever it does wrong, it is not the fixed form
        return f"raised {type(exc).__name__}: {exc}"
    if stored != [0, 1]:
        kept = "no backward's gradient" if not stored else f"the CPU buffer at backwards {stored} only"
        return f"keeps {kept} of a step of 2 backwards with gradient_accumulation_steps 1"
    return None
