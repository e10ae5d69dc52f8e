# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""ZeRO-2 with ``offload_optimizer``: several ``backward()`` calls in one optimizer step must all count.

A step can take several backwards with ``gradient_accumulation_steps: 1``, each but the last outside the accumulation
boundary (``engine.set_gradient_accumulation_boundary``): Accelerate's ``DeepSpeedEngineWrapper`` does so on every
backward, as do trainers that split a step into micro-batches of their own. Up to DeepSpeed 0.18.x the offload branch
of ``copy_grads_in_partition`` keeps a backward's gradient for the next one only ``if gradient_accumulation_steps >
1``, so such a step trains on its last backward alone. DeepSpeed 0.19.0 (pull request 7981) keeps it whenever more
backwards follow. Here the gradient goes through the CPU accumulation buffer whenever gradient accumulation is on (as
before), when the backward is not the boundary (more follow), and at the boundary when an earlier backward stored this
parameter's gradient (``accumulated_grads_in_cpu`` has it): a lone backward per step allocates and copies nothing,
on releases whose first step counts its micro-steps from 1 too. Not part of DeepSpeed pull request 8963
(``DS_OFFLOAD_PATCH_UPSTREAM_ONLY=1`` leaves it out).

One function per form, as each should read in DeepSpeed's file: before 0.17.1 the boundary calls
``update_overflow_tracker_for_param_grad``, from 0.17.1 on ``update_offload_overflow_tracker_for_param_grad``; the rest
of the two is the same text (``ci/make_patches.py`` writes ``patches/`` from each).
"""

import torch


def copy_grads_in_partition_param_tracker(self, param):
    if self.cpu_offload:

        # Through the CPU buffer whenever this step has more than one backward: gradient accumulation, a backward
        # that others follow, or the last of several (an earlier one stored this parameter's gradient).
        if (self.gradient_accumulation_steps > 1 or not self.is_gradient_accumulation_boundary
                or self.get_param_id(param) in self.accumulated_grads_in_cpu):
            self.async_accumulate_grad_in_cpu_via_gpu(param)

        if self.is_gradient_accumulation_boundary:
            self.set_norm_for_param_grad_in_gpu(param)

            self.update_overflow_tracker_for_param_grad(param)

            self.async_inplace_copy_grad_to_fp32_buffer_from_gpu(param)

        return
    #print(f"ID {self.get_param_id(param)} grad norm {param.grad.norm()}")
    if self.grads_in_partition is None:
        self.grads_in_partition_offset = 0
        total_size = 0
        for group in self.params_in_partition:
            for param_in_partition in group:
                total_size += param_in_partition.numel()

        see_memory_usage(f"before copying {total_size} gradients into partition")
        self.grads_in_partition = torch.empty(int(total_size),
                                              dtype=self.dtype,
                                              device=get_accelerator().current_device_name())
        see_memory_usage(f"after copying {total_size} gradients into partition")

    grad_reduc = self.get_gradient_for_reduction(param)
    # The allreduce buffer will be rewritten. Copy the gradients in partition to a new buffer
    new_grad_tensor = self.grads_in_partition.view(-1).narrow(0, self.grads_in_partition_offset, param.numel())
    new_grad_tensor.copy_(grad_reduc.view(-1))
    grad_reduc.data = new_grad_tensor.data.view_as(grad_reduc)
    #print(f"Grad norm after copy to contiguous_buffer {param.grad.data.norm()}")
    self.grads_in_partition_offset += param.numel()


def copy_grads_in_partition(self, param):
    if self.cpu_offload:

        # Through the CPU buffer whenever this step has more than one backward: gradient accumulation, a backward
        # that others follow, or the last of several (an earlier one stored this parameter's gradient).
        if (self.gradient_accumulation_steps > 1 or not self.is_gradient_accumulation_boundary
                or self.get_param_id(param) in self.accumulated_grads_in_cpu):
            self.async_accumulate_grad_in_cpu_via_gpu(param)

        if self.is_gradient_accumulation_boundary:
            self.set_norm_for_param_grad_in_gpu(param)

            self.update_offload_overflow_tracker_for_param_grad(param)

            self.async_inplace_copy_grad_to_fp32_buffer_from_gpu(param)

        return
    #print(f"ID {self.get_param_id(param)} grad norm {param.grad.norm()}")
    if self.grads_in_partition is None:
        self.grads_in_partition_offset = 0
        total_size = 0
        for group in self.params_in_partition:
            for param_in_partition in group:
                total_size += param_in_partition.numel()

        see_memory_usage(f"before copying {total_size} gradients into partition")
        self.grads_in_partition = torch.empty(int(total_size),
                                              dtype=self.dtype,
                                              device=get_accelerator().current_device_name())
        see_memory_usage(f"after copying {total_size} gradients into partition")

    grad_reduc = self.get_gradient_for_reduction(param)
    # The allreduce buffer will be rewritten. Copy the gradients in partition to a new buffer
    new_grad_tensor = self.grads_in_partition.view(-1).narrow(0, self.grads_in_partition_offset, param.numel())
    new_grad_tensor.copy_(grad_reduc.view(-1))
    grad_reduc.data = new_grad_tensor.data.view_as(grad_reduc)
    #print(f"Grad norm after copy to contiguous_buffer {param.grad.data.norm()}")
    self.grads_in_partition_offset += param.numel()


# Imported last: importing DeepSpeed from here may run the patch hook, which reads the functions above. They look
# these names up when they are called, as DeepSpeed's own methods do.
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.runtime.utils import see_memory_usage  # noqa: E402
