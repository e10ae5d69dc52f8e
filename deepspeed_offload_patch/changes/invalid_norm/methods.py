# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The invalid-norm fix: ``_update_scale`` and ``scaled_global_norm`` of ``DeepSpeedZeroOptimizer``.

With ``offload_optimizer``, DeepSpeed 0.14.0 - 0.19.7 check a ZeRO-1/2 step's gradients for inf/NaN only in fp16 and
in bf16 with ``check_grad_overflow`` on (0.17.1 and later; bf16 before 0.17.1 has no check). In the other steps an
inf/NaN reaches ``scaled_global_norm``, whose group norm DeepSpeed masks to -1:

* 0.14.0 - 0.17.0 return that -1 as a Python ``int``: the stacked group norms are an integer tensor and
  ``vector_norm`` raises, so ``step()`` crashes;
* 0.17.1 - 0.19.7 return it as a float tensor: ``vector_norm`` squares it into a finite 1.0, the step is applied and
  the fp32 master weights turn NaN.

Here ``_update_scale``, which ``step()`` calls right before it branches on ``self.overflow``, computes the step's
gradient norm in those steps and takes a group norm of -1 as an overflow, as DeepSpeed 0.19.8 does: the step goes
down DeepSpeed's own overflow path (nothing changes, the gradients are cleared, the engine counts the step as skipped).
The norm is computed once per step: ``scaled_global_norm`` hands the one ``_update_scale`` computed back to ``step()``.
One host read per step is added (whether a group norm was -1), none per tensor. bf16 with ``check_grad_overflow``
set to false is the user's opt-out and is left as 0.19.8 leaves it; fp16 and bf16 with the check on are checked by
DeepSpeed already. A step without an inf/NaN is computed exactly as before.
"""

import torch


def _update_scale(self, has_overflow=False):
    # One text for every release (DeepSpeed's own never changed), hence hasattr: before 0.17.1 bf16 has no
    # check_grad_overflow, and no check ran; from 0.17.1 a bf16 step was checked, or the user turned the check off.
    unchecked = self.dtype == torch.float32 or (self.dtype == torch.bfloat16
                                                and not hasattr(self, "check_grad_overflow"))
    if self.cpu_offload and unchecked:
        # The norm step() computes next, computed now to decide the step: an inf/NaN makes a group norm -1.
        self._step_grad_norm = self.scaled_global_norm()
        # No check sets the flag in these steps: it is this fix's own, decided anew each step (the one host read it
        # adds per step), so a skipped step does not make the next one skip.
        self.overflow = has_overflow = bool(self._step_grad_norm_invalid.item())
        if has_overflow:
            self._step_grad_norm = None
    self.loss_scaler.update_scale(has_overflow)


def scaled_global_norm(self, norm_type=2):
    # The form whose offload group norm is a float tensor (-1.0 for an inf/NaN).
    norm = getattr(self, "_step_grad_norm", None)
    if norm is not None:
        # Computed by _update_scale for this step: hand it back rather than reduce it twice.
        self._step_grad_norm = None
        return norm
    assert norm_type == 2, "only L2 norm supported"
    norm_groups = []
    for i, group in enumerate(self.bit16_groups):
        if self.cpu_offload:
            norm = self.complete_grad_norm_calculation_for_cpu_offload(self.params_in_partition[i])
            norm_groups.append(norm)
        else:
            norm_groups.append(self.get_grad_norm_direct(self.averaged_gradients[i], self.params_in_partition[i]))

    if self.has_moe_layers:
        self._average_expert_grad_norms(norm_groups)

    norms = torch.stack(norm_groups)
    # A group norm below zero is the -1 of an inf/NaN, which the L2 norm below squares into a finite 1.0.
    self._step_grad_norm_invalid = (norms < 0).any()
    return torch.linalg.vector_norm(norms, ord=norm_type)


# The lines above again, on purpose: each form becomes DeepSpeed's own method in patches/, its release's text.
def scaled_global_norm_of_numbers(self, norm_type=2):
    # The form whose offload group norm is a Python number (the int -1 for an inf/NaN).
    norm = getattr(self, "_step_grad_norm", None)
    if norm is not None:
        # Computed by _update_scale for this step: hand it back rather than reduce it twice.
        self._step_grad_norm = None
        return norm
    assert norm_type == 2, "only L2 norm supported"
    norm_groups = []
    for i, group in enumerate(self.bit16_groups):
        if self.cpu_offload:
            # As a float: the int -1 made the stacked norms an integer tensor, which the L2 norm refuses.
            norm = self.complete_grad_norm_calculation_for_cpu_offload(self.params_in_partition[i])
            norm_groups.append(torch.tensor(float(norm), device=self.device))
        else:
            norm_groups.append(self.get_grad_norm_direct(self.averaged_gradients[i], self.params_in_partition[i]))

    if self.has_moe_layers:
        self._average_expert_grad_norms(norm_groups)

    norms = torch.stack(norm_groups)
    # A group norm below zero is the -1 of an inf/NaN, which the L2 norm below squares into a finite 1.0.
    self._step_grad_norm_invalid = (norms < 0).any()
    return torch.linalg.vector_norm(norms, ord=norm_type)


def scaled_global_norm_of_numbers_torch_norm(self, norm_type=2):
    # The same, in the releases that take the L2 norm with torch.norm (0.14.0 - 0.16.2).
    norm = getattr(self, "_step_grad_norm", None)
    if norm is not None:
        # Computed by _update_scale for this step: hand it back rather than reduce it twice.
        self._step_grad_norm = None
        return norm
    assert norm_type == 2, "only L2 norm supported"
    norm_groups = []
    for i, group in enumerate(self.bit16_groups):
        if self.cpu_offload:
            # As a float: the int -1 made the stacked norms an integer tensor, which the L2 norm refuses.
            norm = self.complete_grad_norm_calculation_for_cpu_offload(self.params_in_partition[i])
            norm_groups.append(torch.tensor(float(norm), device=self.device))
        else:
            norm_groups.append(self.get_grad_norm_direct(self.averaged_gradients[i], self.params_in_partition[i]))

    if self.has_moe_layers:
        self._average_expert_grad_norms(norm_groups)

    norms = torch.stack(norm_groups)
    # A group norm below zero is the -1 of an inf/NaN, which the L2 norm below squares into a finite 1.0.
    self._step_grad_norm_invalid = (norms < 0).any()
    return torch.norm(norms, p=norm_type)
