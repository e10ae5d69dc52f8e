# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Second change, on by default where DeepSpeed has the defect: a skipped step leaves no gradient behind.

DeepSpeed 0.19.8 accumulates gradients in a compact fp32 partition buffer (kept in ``averaged_gradients[i]``) when
``grad_accum_dtype`` is fp32 and the model's dtype is not. When ``step()`` skips a step for an inf/NaN, its overflow
branch drops ``averaged_gradients`` only without offload; with ``offload_optimizer`` it calls ``reset_cpu_buffers()``
instead, which leaves the buffer, and its inf/NaN, in place. Every later boundary backward adds into it, so every later
step overflows too: one bad batch freezes a bf16 job, and an fp16 job halves its loss scale until it reaches the floor.

Here ``reset_cpu_buffers`` does what it did and, when the step it ends was skipped (``self.overflow``), also drops
the compact buffers, as the branch without offload drops its gradients: the next boundary builds a zeroed one, as
after a step that was taken. After a step that was taken the buffers are already dropped, so nothing else changes.
Not part of DeepSpeed pull request 8963 (``DS_OFFLOAD_PATCH_UPSTREAM_ONLY=1`` leaves it out).
"""


def reset_cpu_buffers(self):
    # DeepSpeed's own reset, and after a skipped step the compact buffers dropped too.
    self._wait_for_offload_copies()
    self.norm_for_param_grads = {}
    self.local_overflow = False
    if getattr(self, "overflow", False):
        # A skipped step: its gradients, inf/NaN included, must not reach the next step.
        for group_idx in list(self.averaged_gradients):
            if self._use_compact_grad_partition_buffer(group_idx):
                self.averaged_gradients[group_idx] = None
