# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The whole change to DeepSpeed: two methods of ``DeepSpeedZeroOptimizer``, in each form DeepSpeed shipped them.

They replace, on the class in ``deepspeed/runtime/zero/stage_1_and_2.py``, the methods of the same names:

* The tracker put the device result of ``_has_inf_or_nan`` into a Python ``if``: one host synchronization per
  partition gradient at every accumulation boundary, even when nothing reads the flag. Here it returns at once when
  nothing will read the flag, and otherwise ORs the result into a device bool. From DeepSpeed 0.17.1 the tracker is
  ``update_offload_overflow_tracker(grad)`` and the flag is read when ``check_grad_overflow`` is on; before, it is
  ``update_overflow_tracker_for_param_grad(param)`` and ``step()`` reads the flag in fp16 only.
* ``has_overflow()`` wrapped the host bool in a new tensor. Here it converts the device flag (or the initial
  Python ``False``) into the uint8 tensor it all-reduces; the host reads it once, after the all-reduce.

Signatures are unchanged, so callers such as ``deepspeed.utils.tensor_fragment.set_full_hp_grad`` need no change.
Each function is the text of one method in DeepSpeed's file (``ci/make_patches.py`` writes ``patches/`` from them), so
the forms repeat a few lines rather than share a helper that DeepSpeed's file would not have.
"""

import torch


def update_offload_overflow_tracker(self, grad):
    # Built via __new__ (tests, tools), an optimizer may lack the attribute: the constructor defaults it to True.
    if grad is None or not getattr(self, "check_grad_overflow", True):
        return
    found = self._has_inf_or_nan(grad.data)
    if not torch.is_tensor(found):
        # An override that already answers on the host; keep the flag a tensor all the same.
        found = torch.tensor(bool(found))
    # Both result shapes (fp32 0/1 in older releases, bool in newer) give a bool flag. It lives on the accelerator, so a
    # result from another device (a CPU value given to safe_set_full_grad) can be ORed into it.
    found = found.to(device=get_accelerator().current_device_name(), dtype=torch.bool)
    flag = getattr(self, "local_overflow", False)
    # Out of place, so the flag never aliases a tensor that _has_inf_or_nan returned.
    self.local_overflow = flag | found if torch.is_tensor(flag) else found | bool(flag)


def update_overflow_tracker_for_param_grad(self, param):
    # The form that takes the parameter, where step() reads the flag in fp16 only (through check_overflow).
    # An optimizer built via __new__ without a dtype checks, as an fp16 one would.
    if getattr(self, "dtype", torch.float16) != torch.float16:
        return
    grad_accum = self.get_param_gradient_attribute(param)
    if grad_accum is None:
        return
    found = self._has_inf_or_nan(grad_accum.data)
    if not torch.is_tensor(found):
        found = torch.tensor(bool(found))
    # The check gives an fp32 0/1: keep its OR as a bool flag on the accelerator.
    found = found.to(device=get_accelerator().current_device_name(), dtype=torch.bool)
    flag = getattr(self, "local_overflow", False)
    self.local_overflow = flag | found if torch.is_tensor(flag) else found | bool(flag)


def has_overflow(self, partition_gradients=True):
    # The form that all-reduces the flag over the data parallel group whatever partition_gradients says.
    if self.cpu_offload:
        flag = self.local_overflow
        if torch.is_tensor(flag):
            overflow_gpu = flag.to(device=get_accelerator().current_device_name(), dtype=torch.uint8).reshape(1)
        else:
            overflow_gpu = get_accelerator().ByteTensor([flag])
    else:
        overflow = self.has_overflow_partitioned_grads_serial()
        overflow_gpu = overflow.byte().to(get_accelerator().current_device_name())

    dist.all_reduce(overflow_gpu, op=dist.ReduceOp.MAX, group=self.dp_process_group)

    # Each model parallel rank holds part of the model: agree on the flag across them too.
    self._model_parallel_all_reduce(tensor=overflow_gpu, op=dist.ReduceOp.MAX)

    # The one host read of the flag per step.
    overflow = overflow_gpu[0].item()
    return bool(overflow)


def has_overflow_dp_if_partitioned(self, partition_gradients=True):
    # The form that all-reduces over data parallel ranks only when gradients are
    # partitioned. Kept as it was: the patch changes where the flag lives, nothing else.
    if self.cpu_offload:
        flag = self.local_overflow
        if torch.is_tensor(flag):
            overflow_gpu = flag.to(device=get_accelerator().current_device_name(), dtype=torch.uint8).reshape(1)
        else:
            overflow_gpu = get_accelerator().ByteTensor([flag])
    else:
        overflow = self.has_overflow_partitioned_grads_serial()
        overflow_gpu = overflow.byte().to(get_accelerator().current_device_name())

    if partition_gradients:
        dist.all_reduce(overflow_gpu, op=dist.ReduceOp.MAX, group=self.dp_process_group)

    self._model_parallel_all_reduce(tensor=overflow_gpu, op=dist.ReduceOp.MAX)

    overflow = overflow_gpu[0].item()
    return bool(overflow)


def has_overflow_serial_if_not_partitioned(self, partition_gradients=True):
    # The form whose offload flag counts only with partition_gradients (step() passes
    # the default, True); otherwise the bit16 parameters' gradients are checked. Kept as it was.
    if partition_gradients:
        if self.cpu_offload:
            flag = self.local_overflow
            if torch.is_tensor(flag):
                overflow_gpu = flag.to(get_accelerator().current_device_name(), torch.uint8).reshape(1)
            else:
                overflow_gpu = get_accelerator().ByteTensor([flag])
        else:
            overflow = self.has_overflow_partitioned_grads_serial()
            overflow_gpu = overflow.byte().to(get_accelerator().current_device_name())
        dist.all_reduce(overflow_gpu, op=dist.ReduceOp.MAX, group=self.dp_process_group)
    else:
        params = [param for group in self.bit16_groups for param in group]
        overflow_gpu = self.has_overflow_serial(params).byte().to(get_accelerator().current_device_name())

    self._model_parallel_all_reduce(tensor=overflow_gpu, op=dist.ReduceOp.MAX)

    overflow = overflow_gpu[0].item()
    return bool(overflow)


# Imported last: importing DeepSpeed from here may run the patch hook, which reads the functions above. They look
# these names up when they are called, as DeepSpeed's own methods do.
from deepspeed import comm as dist  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
