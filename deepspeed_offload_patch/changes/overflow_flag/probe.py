# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The overflow flag fix's behavioural probe: does a tracker in no known form behave as the fixed one?"""

from typing import Optional

#: The tracker the probe runs (the current form's; the older form's is only ever matched by its fingerprint).
TRACKER = "update_offload_overflow_tracker"


def probe_tracker(cls: type) -> Optional[str]:
    """Try ``cls.update_offload_overflow_tracker`` on bare instances (built without ``__init__``); None when it
    behaves as fixed, else what it did.

    Fixed means: with ``check_grad_overflow`` off it checks nothing and leaves the flag alone; with it on, fed check
    results whose truth value raises (:class:`~deepspeed_offload_patch.hostsync.RaisingBoolTensor`), it reads nothing
    on the host (counted at the dispatcher) and leaves a tensor flag that is true exactly when a result was. Every
    tensor stays on the CPU (device arguments are mapped to it); the tracker may still ask the accelerator for its
    device name. Any exception counts as not fixed. Only code that matches no known form is probed.
    """
    import torch

    from deepspeed_offload_patch.hostsync import RaisingBoolTensor, count_host_syncs, on_the_cpu

    tracker = cls.__dict__.get(TRACKER)
    if tracker is None:
        return f"has no {TRACKER}"
    calls = []

    def check(x, j=None):
        calls.append(x)
        return RaisingBoolTensor.wrap(x.float().isinf().logical_or(x.float().isnan()).any())

    def bare(check_on: bool):
        optimizer = cls.__new__(cls)
        optimizer.check_grad_overflow = check_on
        optimizer.cpu_offload = True
        optimizer.local_overflow = False
        optimizer._has_inf_or_nan = check
        return optimizer

    bad = torch.tensor([1.0, float("inf")])
    try:
        with on_the_cpu(), count_host_syncs(device="cpu",
                                            kinds=("read", )) as syncs:  # its tensors are all on the CPU: count all
            off = bare(False)
            tracker(off, bad)
            if calls or off.local_overflow is not False:
                return "checks gradients with check_grad_overflow off"
            clean, flagged = bare(True), bare(True)
            for grad in (torch.ones(3), torch.zeros(2)):
                tracker(clean, grad)
            for grad in (torch.ones(3), bad, torch.zeros(2)):
                tracker(flagged, grad)
        if syncs.total:
            return f"reads device values on the host: {dict(syncs.counts)}"
        flags = [
            RaisingBoolTensor.plain(o.local_overflow) if torch.is_tensor(o.local_overflow) else o.local_overflow
            for o in (clean, flagged)
        ]
        if not all(torch.is_tensor(flag) and flag.numel() == 1 for flag in flags):
            return f"keeps the flag on the host ({type(flags[1]).__name__})"
        if flags[0].item() or not flags[1].item():
            return "the flag does not record exactly the overflows"
    except Exception as exc:  # unknown code: whatever it does wrong, it is not the fixed form
        return f"raised {type(exc).__name__}: {exc}"
    return None
