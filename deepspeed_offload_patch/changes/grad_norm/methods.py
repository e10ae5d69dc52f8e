# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Second change, on by default: the offload gradient norm without one host read per parameter.

``complete_grad_norm_calculation_for_cpu_offload`` in ``step()`` read each owned parameter's gradient norm with
``.item()`` to sum the squares in a Python float: the same defect as the overflow check, in the step instead of the
backward. Here the squares are summed on the device, in float64 and in the loop's order, so the total is the same
double the Python loop makes (each ``float ** 2`` and ``+`` is one correctly rounded IEEE operation either way), and
it reaches the device tensor that is all-reduced through the same float64-to-float32 rounding. The host reads once,
after the all-reduce, as before. Not part of DeepSpeed pull request 8963: ``DS_OFFLOAD_PATCH_GRAD_NORM=0`` or
``DS_OFFLOAD_PATCH_UPSTREAM_ONLY=1`` leave it out.

Two forms, as DeepSpeed has two: 0.17.1 and later return the norm as a float32 tensor; 0.14.0 to 0.17.0 return a Python
number (``-1`` for an inf/NaN norm), built from the same float32 all-reduce.
"""

import torch


def complete_grad_norm_calculation_for_cpu_offload(self, params):
    # The form that returns the norm as a float32 tensor.
    total_norm = torch.zeros((), dtype=torch.float64, device=get_accelerator().current_device_name())
    norm_type = 2.0
    for p in params:
        # Pipeline parallelism may replicate parameters: count each once.
        if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
            continue

        if is_model_parallel_parameter(p) or (self.model_parallel_rank == 0):
            param_id = self.get_param_id(p)
            # Parameters that took no part in this step have no norm (their hooks did not run).
            if param_id in self.norm_for_param_grads:
                param_norm = self.norm_for_param_grads[param_id]
                total_norm += param_norm.to(total_norm.device, torch.float64)**2
            else:
                assert self.ignore_unused_parameters, (
                    "a trainable parameter has no gradient norm because it took no part in the loss: set "
                    "zero_optimization.ignore_unused_parameters, or make every trainable parameter reach the loss")

    # The float32 tensor the unpatched code builds from the Python total, built on the device instead.
    total_dev_norm = total_norm.to(torch.float32).reshape(1)
    dist.all_reduce(total_dev_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)

    self._model_parallel_all_reduce(tensor=total_dev_norm, op=dist.ReduceOp.SUM)

    total_norm = total_dev_norm[0].item()**(1. / norm_type)

    if total_norm == float('inf') or total_norm == -float('inf') or total_norm != total_norm:
        total_norm = -1.0

    return torch.tensor(total_norm, device=self.device, dtype=torch.float)


# The loop repeats the one above on purpose: each replacement becomes DeepSpeed's own method in patches/, where a
# helper of this module would not exist (ci/make_patches.py checks that a patched method reads only its module's names).
def complete_grad_norm_returning_a_number(self, params):
    # The form that returns the norm as a Python number: the same sum, the same all-reduce.
    total_norm = torch.zeros((), dtype=torch.float64, device=get_accelerator().current_device_name())
    norm_type = 2.0
    for p in params:
        # Pipeline parallelism may replicate parameters: count each once.
        if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
            continue

        if is_model_parallel_parameter(p) or (self.model_parallel_rank == 0):
            param_id = self.get_param_id(p)
            # Parameters that took no part in this step have no norm (their hooks did not run).
            if param_id in self.norm_for_param_grads:
                param_norm = self.norm_for_param_grads[param_id]
                total_norm += param_norm.to(total_norm.device, torch.float64)**2
            else:
                assert self.ignore_unused_parameters, (
                    "a trainable parameter has no gradient norm because it took no part in the loss: set "
                    "zero_optimization.ignore_unused_parameters, or make every trainable parameter reach the loss")

    # The float32 one-element tensor the unpatched code builds from the Python total, built on the device instead.
    total_dev_norm = total_norm.to(torch.float32).reshape(1)
    dist.all_reduce(total_dev_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)

    self._model_parallel_all_reduce(tensor=total_dev_norm, op=dist.ReduceOp.SUM)

    total_norm = total_dev_norm[0].item()**(1. / norm_type)

    if total_norm == float('inf') or total_norm == -float('inf') or total_norm != total_norm:
        total_norm = -1

    return total_norm


# Imported last, as in the overflow flag fix's methods: importing DeepSpeed may run the patch hook.
from deepspeed import comm as dist  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.runtime.utils import is_model_parallel_parameter  # noqa: E402
from deepspeed.runtime.constants import PIPE_REPLICATED  # noqa: E402
