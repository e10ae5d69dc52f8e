# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Test helpers that prove code does not read device values on the host, on any device (CPU included).

* :func:`no_host_sync` raises :class:`HostSyncError` at the first host read, naming the op and the Python line.
* :func:`count_host_syncs` counts host reads by op instead.
* :class:`RaisingBoolTensor` is a tensor whose truth value cannot be taken, to feed through code under test.

They live in :mod:`deepspeed_offload_patch.hostsync` (what counts where is said there) and are re-exported here;
:func:`allow_fp16_on_cpu` is for tests that train in fp16 on DeepSpeed's CPU accelerator.
"""

from deepspeed_offload_patch.hostsync import (HostSyncCounter, HostSyncError, RaisingBoolTensor, count_host_syncs,
                                              no_host_sync, on_the_cpu, run_device_type)

__all__ = [
    "HostSyncError", "HostSyncCounter", "RaisingBoolTensor", "count_host_syncs", "no_host_sync", "on_the_cpu",
    "run_device_type", "allow_fp16_on_cpu"
]


def allow_fp16_on_cpu() -> bool:
    """Let DeepSpeed's CPU accelerator train in fp16, which it declines (``is_fp16_supported()`` is False) although
    torch runs fp16 on the CPU. Call it in each rank before ``deepspeed.initialize``; it changes only the CPU
    accelerator object of this process, and returns whether it did (False on any other accelerator).

    Tests need it: fp16 with dynamic loss scaling is the precision where overflow is routine, and before DeepSpeed
    0.17.1 the only one whose overflow flag is read.
    """
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return False
    accelerator.is_fp16_supported = lambda: True
    return True
