# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The rank-agreement fix: ``_check_overflow`` of ``DeepSpeedZeroOptimizer``.

DeepSpeed 0.17.1 - 0.17.6 have ``step()`` check for an overflow with ``partition_gradients=self.partition_gradients``,
and ``has_overflow`` all-reduce the flag over the data parallel ranks only when that is true (ZeRO-2). With
``offload_optimizer`` each rank's flag covers the gradients of its own partition, so at ZeRO-1 (fp16, or bf16 with the
check on) an inf on one rank makes that rank skip the step while the others take it, and the next collective fails or
hangs. Here the check asks for the all-reduce whenever the optimizer is offloaded, as DeepSpeed 0.18.0 does at every
stage: the ranks agree, and all skip. Without offload nothing changes; where ``has_overflow`` all-reduces anyway
(every other release) the argument changes nothing.
"""


def _check_overflow(self, partition_gradients=True):
    # Offloaded, each rank's flag covers only its own partition: agree on it over the data parallel ranks.
    self.overflow = self.has_overflow(partition_gradients or self.cpu_offload)
