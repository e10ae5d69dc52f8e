# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The event-wait fix's behavioural probe: does an accumulation method in no known form make the host wait once per
tensor?"""

from typing import Optional

#: The method the probe runs.
METHOD = "async_accumulate_grad_in_cpu_via_gpu"
TENSORS = 3


def probe_waits(cls: type) -> Optional[str]:
    """Run ``cls.async_accumulate_grad_in_cpu_via_gpu`` for three tensors of one backward (micro-step 1 of 2, not the
    boundary) on a bare instance (built without ``__init__``) whose copy-safety bookkeeping is stubbed: every
    ``_record_offload_copy`` leaves a pending copy, and a ``_wait_for_offload_copies`` call that finds one is a host
    wait. None when the backward makes at most one such wait (pageable buffers, the harder case), else how many it
    made.

    One parameter of 3 elements per tensor, offloaded to the CPU. Any exception counts as not fixed. Only code that
    matches no known form is probed.
    """
    import torch

    method = cls.__dict__.get(METHOD)
    if method is None:
        return f"has no {METHOD}"
    numel = 3
    pending, waits = [], []

    def record():
        pending.append(object())

    def wait():
        if pending:
            waits.append(len(pending))
        pending.clear()

    optimizer = cls.__new__(cls)
    try:
        vars(optimizer).update(grad_position={tensor: [0, 0, 0, numel]
                                              for tensor in range(TENSORS)},
                               temp_grad_buffer_for_gpu_offload=torch.zeros(numel),
                               accumulated_grads_in_cpu={tensor: torch.zeros(numel)
                                                         for tensor in range(TENSORS)},
                               fp16_master_weights_and_gradients=False,
                               low_precision_master_weights_and_grads=False,
                               cpu_offload_pin_memory=False,
                               device="cpu",
                               gradient_accumulation_steps=2,
                               micro_step_id=1,
                               is_gradient_accumulation_boundary=False,
                               _offload_gradient_safety_enabled=True,
                               _offload_accumulated_param_ids=set(),
                               _pending_offload_events={},
                               get_param_gradient_attribute=lambda param: param,
                               _wait_for_offload_copies=wait,
                               _record_offload_copy=record)
        record()  # a copy of the backward before
        for tensor in range(TENSORS):
            optimizer.get_param_id = lambda param, tensor=tensor: tensor
            method(optimizer, torch.ones(numel))
    except Exception as exc:  # unknown code: whatever it does wrong, it is not the fixed form
        return f"raised {type(exc).__name__}: {exc}"
    if len(waits) > 1:
        return f"makes the host wait {len(waits)} times in one backward of {TENSORS} tensors (once per tensor)"
    return None
