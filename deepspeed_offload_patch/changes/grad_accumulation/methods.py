# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""ZeRO-2 with ``offload_optimizer`` accumulates each micro-step's gradient through a CPU buffer: every micro-step but
the boundary's stores the running sum there, and every micro-step after the first adds it back before storing.

DeepSpeed 0.15.2 (pull request 6550) made the store happen at micro-step 0 only, so from the third micro-step on the
sum is rebuilt from micro-step 0 alone and the ones between are lost: at ``gradient_accumulation_steps: 4`` the step
trains on micro-batches 0 and 3. 0.19.0 (pull request 7967) stores at every micro-step again. Here the running sum is
stored at every micro-step that another one follows (not at the boundary, whose sum goes to the fp32 partition and
is never read back): the gradient of 0.15.1 and of 0.19.0, with one copy fewer per tensor than 0.19.0 at the
boundary. Not part of DeepSpeed pull request 8963 (``DS_OFFLOAD_PATCH_UPSTREAM_ONLY=1`` leaves it out).

One function per form, as each should read in DeepSpeed's file: before 0.18.3 the low-precision master option is
``fp16_master_weights_and_gradients``, from 0.18.3 on ``low_precision_master_weights_and_grads``; the rest of the two
is the same text (``ci/make_patches.py`` writes ``patches/`` from each).
"""

import torch


# yapf: disable
# (DeepSpeed's own wrapping of its lines, which yapf would rewrap: the diffs under patches/ change only what the fix
# changes.)
def async_accumulate_grad_in_cpu_via_gpu_fp16_master(self, param):
    param_id = self.get_param_id(param)

    [i, source_offset, dest_offset, num_elements] = self.grad_position[param_id]

    # copy to a preexisiting buffer to avoid memory allocation penalty
    dest_buffer = self.temp_grad_buffer_for_gpu_offload.view(-1).narrow(0, 0, param.numel())

    #buffer for storing gradients for this parameter in CPU
    def buffer_to_accumulate_to_in_cpu():
        if not self.fp16_master_weights_and_gradients:
            buffer = torch.zeros(param.numel(), dtype=param.dtype, device=self.device)
            return get_accelerator().pin_memory(buffer) if self.cpu_offload_pin_memory else buffer
        else:
            return self.single_partition_of_fp32_groups[i].grad.view(-1).narrow(0, dest_offset, num_elements)

    #accumulate gradients into param.grad_accum or parts of it that belongs to this partition
    def accumulate_gradients():
        grad_accum = self.get_param_gradient_attribute(param)
        if not self.fp16_master_weights_and_gradients:
            dest_buffer.copy_(self.accumulated_grads_in_cpu[param_id].view(-1), non_blocking=True)
            grad_accum.data.view(-1).add_(dest_buffer)
        else:
            dest_buffer.narrow(0, source_offset,
                               num_elements).copy_(self.accumulated_grads_in_cpu[param_id].view(-1),
                                                   non_blocking=True)
            grad_accum.data.view(-1).narrow(0, source_offset,
                                            num_elements).add_(dest_buffer.narrow(0, source_offset, num_elements))

    #move accumulated gradients back to CPU
    def copy_gradients_to_cpu():
        grad_accum = self.get_param_gradient_attribute(param)
        if not self.fp16_master_weights_and_gradients:
            self.accumulated_grads_in_cpu[param_id].data.copy_(grad_accum.data.view(-1), non_blocking=True)
        else:
            self.accumulated_grads_in_cpu[param_id].data.copy_(grad_accum.data.view(-1).narrow(
                0, source_offset, num_elements),
                                                               non_blocking=True)

    if param_id not in self.accumulated_grads_in_cpu:
        self.accumulated_grads_in_cpu[param_id] = buffer_to_accumulate_to_in_cpu()

    if self.micro_step_id > 0:
        accumulate_gradients()
    # The running sum, for the micro-steps that follow: storing it at micro-step 0 only loses those in between.
    if not self.is_gradient_accumulation_boundary:
        copy_gradients_to_cpu()


def async_accumulate_grad_in_cpu_via_gpu(self, param):
    param_id = self.get_param_id(param)

    [i, source_offset, dest_offset, num_elements] = self.grad_position[param_id]

    # copy to a preexisiting buffer to avoid memory allocation penalty
    dest_buffer = self.temp_grad_buffer_for_gpu_offload.view(-1).narrow(0, 0, param.numel())

    #buffer for storing gradients for this parameter in CPU
    def buffer_to_accumulate_to_in_cpu():
        if not self.low_precision_master_weights_and_grads:
            buffer = torch.zeros(param.numel(), dtype=param.dtype, device=self.device)
            return get_accelerator().pin_memory(buffer) if self.cpu_offload_pin_memory else buffer
        else:
            return self.single_partition_of_fp32_groups[i].grad.view(-1).narrow(0, dest_offset, num_elements)

    #accumulate gradients into param.grad_accum or parts of it that belongs to this partition
    def accumulate_gradients():
        grad_accum = self.get_param_gradient_attribute(param)
        if not self.low_precision_master_weights_and_grads:
            dest_buffer.copy_(self.accumulated_grads_in_cpu[param_id].view(-1), non_blocking=True)
            grad_accum.data.view(-1).add_(dest_buffer)
        else:
            dest_buffer.narrow(0, source_offset,
                               num_elements).copy_(self.accumulated_grads_in_cpu[param_id].view(-1),
                                                   non_blocking=True)
            grad_accum.data.view(-1).narrow(0, source_offset,
                                            num_elements).add_(dest_buffer.narrow(0, source_offset, num_elements))

    #move accumulated gradients back to CPU
    def copy_gradients_to_cpu():
        grad_accum = self.get_param_gradient_attribute(param)
        if not self.low_precision_master_weights_and_grads:
            self.accumulated_grads_in_cpu[param_id].data.copy_(grad_accum.data.view(-1), non_blocking=True)
        else:
            self.accumulated_grads_in_cpu[param_id].data.copy_(grad_accum.data.view(-1).narrow(
                0, source_offset, num_elements),
                                                               non_blocking=True)

    if param_id not in self.accumulated_grads_in_cpu:
        self.accumulated_grads_in_cpu[param_id] = buffer_to_accumulate_to_in_cpu()

    if self.micro_step_id > 0:
        accumulate_gradients()
    # The running sum, for the micro-steps that follow: storing it at micro-step 0 only loses those in between.
    if not self.is_gradient_accumulation_boundary:
        copy_gradients_to_cpu()


# yapf: enable

# Imported last: importing DeepSpeed from here may run the patch hook, which reads the functions above. They look
# these names up when they are called, as DeepSpeed's own methods do.
from deepspeed.accelerator import get_accelerator  # noqa: E402
