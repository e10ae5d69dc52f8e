# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""ZeRO-2 with ``offload_optimizer`` and gradient accumulation stores each tensor's running gradient sum in a CPU
buffer and reads it back at the next micro-step. DeepSpeed 0.19.8 orders those copies with events: before each
tensor, ``async_accumulate_grad_in_cpu_via_gpu`` makes the host wait (``Event.synchronize``) for the copies recorded
so far, which are the previous tensor's, so on a GPU the host stalls once per parameter tensor in every backward,
until the device has finished the backward up to that tensor. ``_restore_cpu_offload_grad_to_gpu`` waits per tensor
too.

What a tensor reads back is its own sum, stored by an earlier backward; DeepSpeed's comment names the hazard: a
pageable CPU source is staged by the host when the copy is issued, possibly before a wait on the device runs. So here:

* pinned CPU buffers (``pin_memory: true``, DeepSpeed's default since 0.19.5): the device reads them in stream order,
  so the stream that reads waits on the other streams' events on the device, and the host does not wait at all;
* pageable ones: the host waits once per backward (once per boundary pass, for the restore) for the copies recorded
  before it, which are the only ones a tensor's read depends on.

Every copy and add stays, in the same order on the same stream: the results are the same bits. Not part of DeepSpeed
pull request 8963; opt-in until a GPU has proven it (``DS_OFFLOAD_PATCH_EVENT_WAITS=1``).
"""

import torch


# yapf: disable
# (DeepSpeed's own wrapping of its lines, which yapf would rewrap: the diffs under patches/ change only what the fix
# changes.)
def async_accumulate_grad_in_cpu_via_gpu(self, param):
    param_id = self.get_param_id(param)

    if self._offload_gradient_safety_enabled:
        # A pageable CPU source may be staged before a GPU wait executes: the host waits, once per backward, for the
        # copies of earlier backwards (the ones this tensor's sum comes from). A pinned one is read in stream order.
        window = (self._offload_accumulated_param_ids, self.micro_step_id)
        waited = getattr(self, "_offload_copies_waited_for", (None, None))
        if self.cpu_offload_pin_memory:
            stream = get_accelerator().current_stream()
            for producer, event in self._pending_offload_events.items():
                if producer != stream:
                    stream.wait_event(event)
        elif waited[0] is not window[0] or waited[1] != window[1]:
            self._wait_for_offload_copies()
            self._offload_copies_waited_for = window

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
    copy_gradients_to_cpu()
    self._record_offload_copy()


def _restore_cpu_offload_grad_to_gpu(self, param):
    # Last non-boundary epilogue cleared param.grad; reload accumulated CPU grads for boundary helpers.
    if self._offload_gradient_safety_enabled:
        # As in async_accumulate_grad_in_cpu_via_gpu: once per boundary pass for a pageable source, on the device for
        # a pinned one.
        window = (self._offload_accumulated_param_ids, "restore")
        waited = getattr(self, "_offload_copies_waited_for", (None, None))
        if self.cpu_offload_pin_memory:
            stream = get_accelerator().current_stream()
            for producer, event in self._pending_offload_events.items():
                if producer != stream:
                    stream.wait_event(event)
        elif waited[0] is not window[0] or waited[1] != window[1]:
            self._wait_for_offload_copies()
            self._offload_copies_waited_for = window
    param_id = self.get_param_id(param)
    [_, source_offset, dest_offset, num_elements] = self.grad_position[param_id]
    dest_buffer = self.temp_grad_buffer_for_gpu_offload.view(-1).narrow(0, 0, param.numel())
    if not self.low_precision_master_weights_and_grads:
        dest_buffer.copy_(self.accumulated_grads_in_cpu[param_id].view(-1), non_blocking=True)
    else:
        dest_buffer.narrow(0, source_offset, num_elements).copy_(self.accumulated_grads_in_cpu[param_id].view(-1),
                                                                 non_blocking=True)
    # Clone so the shared temp buffer can be reused for the next parameter.
    restored = dest_buffer.view_as(param).clone()
    if self.use_grad_accum_attribute:
        param.grad_accum = restored
    else:
        param.grad = restored


# yapf: enable

# Imported last: importing DeepSpeed from here may run the patch hook, which reads the functions above. They look
# these names up when they are called, as DeepSpeed's own methods do.
from deepspeed.accelerator import get_accelerator  # noqa: E402
