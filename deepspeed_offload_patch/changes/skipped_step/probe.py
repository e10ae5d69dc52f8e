# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The skipped-step fix's behavioural probe: does a ``step()`` in no known form leave a skipped step's gradient
behind?"""

from typing import Optional


class _BufferGroup(list):
    """A compact gradient partition group as DeepSpeed 0.19.8 keeps one: views, and the flat partition they share."""

    def __init__(self, flat_partition):
        super().__init__([flat_partition])
        self.flat_partition = flat_partition


class _Timer:

    def start(self):
        pass

    def stop(self):
        pass


def probe_skipped_step(cls: type) -> Optional[str]:
    """Run ``cls.step`` once on a bare instance (built without ``__init__``) whose overflow check finds an overflow,
    with the optimizer offloaded and a compact gradient buffer holding an inf; None when, after the skipped step, the
    buffer is gone or holds no inf/NaN (DeepSpeed's own fix, in any words, of ``step()`` or ``reset_cpu_buffers``),
    else what it did. ``step()``'s collaborators are stubbed on the instance (the check, the loss scale, the timers,
    waiting for copies); any exception counts as not fixed. Only code that matches no known form is probed."""
    import torch

    optimizer = cls.__new__(cls)
    group = _BufferGroup(torch.tensor([1.0, float("inf")]))

    def check_overflow(partition_gradients=True):
        optimizer.overflow = True

    state = dict(micro_step_id=0,
                 cpu_offload=True,
                 compute_grad_norm=False,
                 check_grad_overflow=True,
                 partition_gradients=True,
                 overflow=False,
                 custom_loss_scaler=True,
                 external_loss_scale=1.0,
                 averaged_gradients={0: group},
                 all_grad_tensors={0: None},
                 norm_for_param_grads={},
                 local_overflow=False,
                 _global_grad_norm=None,
                 _offload_accumulated_param_ids=set(),
                 check_overflow=check_overflow,
                 _wait_for_offload_copies=lambda: None,
                 _update_scale=lambda overflow: None,
                 zero_grad=lambda set_to_none=True: None,
                 timers=lambda name: _Timer(),
                 _use_compact_grad_partition_buffer=lambda group_idx: True)
    try:
        vars(optimizer).update(state)
        cls.step(optimizer)
        if not optimizer.overflow:
            return "did not take the overflow branch"
        left = optimizer.averaged_gradients.get(0)
        tensors = [getattr(left, "flat_partition", None)] + (list(left) if isinstance(left, list) else [left])
        if any(torch.is_tensor(t) and not torch.isfinite(t).all() for t in tensors):
            return "keeps the skipped step's inf/NaN in its compact gradient buffer"
    except Exception as exc:  # unknown code: whatever it does wrong, it is not the fixed form
        return f"raised {type(exc).__name__}: {exc}"
    return None
