# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The ZeRO-3 overflow fix: ``_overflow_check_and_loss_scale_update`` of ``DeepSpeedZeroOptimizer_Stage3``.

DeepSpeed 0.14.0 - 0.19.7 check a ZeRO-3 step's gradients for inf/NaN only in fp16. In bf16 and fp32 with
``offload_optimizer``, an inf reaches the step as a gradient norm of 1.0 (the group norm masks it to -1 and the
``vector_norm`` of the groups makes that 1.0), the step is applied and the fp32 master weights turn NaN. Here the
check that fp16 runs (``check_overflow``: one pass over the rank's gradient partition on the device, one all-reduce,
one host read per step) also runs in the other precisions when the optimizer is offloaded, so such a step goes down
DeepSpeed's own overflow path: nothing changes, the gradients are cleared and the engine counts the step as skipped.
A step without an inf/NaN is computed exactly as before. DeepSpeed 0.19.8 skips such a step by itself (its step checks
the combined norm).

Two forms, as DeepSpeed has two: the second also updates ZeRO++'s LoCo error buffers.
"""

import torch


def overflow_check_and_loss_scale_update(self):
    # The form without LoCo. Offloaded, every precision is checked: bf16 and fp32 have no other guard.
    if self.dtype == torch.float16 or self.offload_optimizer:
        self.check_overflow()

    prev_scale = self.loss_scale
    self._update_scale(self.overflow)

    if self.overflow:
        self._overflow_clean_up(prev_scale)

    return self.overflow


# The lines above again, on purpose: each form becomes DeepSpeed's own method in patches/, its release's text.
def overflow_check_with_loco_update(self):
    # The form with LoCo. Offloaded, every precision is checked: bf16 and fp32 have no other guard.
    if self.dtype == torch.float16 or self.offload_optimizer:
        self.check_overflow()

    prev_scale = self.loss_scale
    self._update_scale(self.overflow)

    if self.overflow:
        self._overflow_clean_up(prev_scale)

    self._loco_err_buf_update(self.overflow, self.loss_scale / prev_scale)

    return self.overflow
