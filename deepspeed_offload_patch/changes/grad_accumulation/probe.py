# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The gradient-accumulation fix's behavioural probe: does an accumulation method in no known form keep every
micro-step?"""

from typing import Optional

#: The method the probe runs.
METHOD = "async_accumulate_grad_in_cpu_via_gpu"
MICRO_STEPS = 3


def probe_accumulation(cls: type) -> Optional[str]:
    """Run ``cls.async_accumulate_grad_in_cpu_via_gpu`` over the three micro-steps of one step (the last at the
    boundary) on a bare instance (built without ``__init__``), each micro-step's gradient a different power of two;
    None when the boundary's gradient is the sum of all three, else which micro-steps it holds.

    The instance offloads to the CPU with pageable buffers, one parameter of 3 elements; the copy-safety waits of
    DeepSpeed 0.19.8 are stubbed. Any exception counts as not fixed. Only code that matches no known form is probed.
    """
    import torch

    method = cls.__dict__.get(METHOD)
    if method is None:
        return f"has no {METHOD}"
    numel = 3
    grads = [torch.full((numel, ), float(2**micro)) for micro in range(MICRO_STEPS)]
    current = {}
    optimizer = cls.__new__(cls)
    try:
        vars(optimizer).update(grad_position={0: [0, 0, 0, numel]},
                               temp_grad_buffer_for_gpu_offload=torch.zeros(numel),
                               accumulated_grads_in_cpu={},
                               fp16_master_weights_and_gradients=False,
                               low_precision_master_weights_and_grads=False,
                               cpu_offload_pin_memory=False,
                               device="cpu",
                               gradient_accumulation_steps=MICRO_STEPS,
                               _offload_gradient_safety_enabled=False,
                               _pending_offload_events={},
                               get_param_id=lambda param: 0,
                               get_param_gradient_attribute=lambda param: current["grad"],
                               _wait_for_offload_copies=lambda: None,
                               _record_offload_copy=lambda: None)
        for micro, grad in enumerate(grads):
            vars(optimizer).update(micro_step_id=micro, is_gradient_accumulation_boundary=micro == MICRO_STEPS - 1)
            current["grad"] = grad.clone()
            method(optimizer, torch.zeros(numel))
        total = current["grad"]
        if not torch.equal(total, sum(grads)):
            value = int(total[0].item())
            held = [str(micro) for micro in range(MICRO_STEPS) if value >> micro & 1]
            return (f"trains on micro-steps {', '.join(held) or 'none'} of 0 - {MICRO_STEPS - 1} at the boundary "
                    f"(gradient {total[0].item():g}, not {sum(grads)[0].item():g})")
    except Exception as exc:  # unknown code: whatever it does wrong, it is not the fixed form
        return f"raised {type(exc).__name__}: {exc}"
    return None
