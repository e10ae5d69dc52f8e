# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""A test-bench condition for ZeRO-3 on the CPU accelerator before DeepSpeed 0.19.8: wait for every parameter
all-gather, not only the last.

``Init._allgather_params_coalesced`` (``deepspeed/runtime/zero/partition_parameters.py``) starts one asynchronous
all-gather per parameter and, on 0.14.0 - 0.19.7, waits for the last handle alone. With NCCL that is enough: the
collectives of one group run in order on one stream. With gloo (DeepSpeed's CPU accelerator) each handle is its own
operation, so a parameter gathered earlier in the list can still be being written when the caller reads it. ZeRO-3
goes this way for its persistent parameters after every step and under ``GatheredParameters``, so a CPU job can train
on, or read back, a half-gathered parameter: the oracle saw cells come out right in one run and wrong in the next
(NaN norms, parameters of 1e20) on every release it ran from 0.14.4 to 0.18.9. DeepSpeed 0.19.8 waits for every
handle there itself.

This is not the offload path and the package does not change it: :func:`wait_every_gather` makes the oracle's ZeRO-3
cells repeatable on those releases, so that what the table reports is how ZeRO-3 with offload trains, not whether the
race was lost. Call it in each rank before ``deepspeed.initialize``.
"""

import threading
from typing import Any, Callable, List, Optional

#: The first release whose ``_allgather_params_coalesced`` waits for every handle itself.
FIXED_IN = "0.19.8"

_local = threading.local()
_installed: Optional[Callable[[], None]] = None
#: Handles :func:`wait_every_gather`'s wrapper waited for, in this process (the tests read it).
waited = 0


def needed() -> bool:
    """Whether the installed DeepSpeed waits for the last all-gather handle alone (before :data:`FIXED_IN`)."""
    import deepspeed
    from packaging.version import Version

    return Version(Version(deepspeed.__version__).base_version) < Version(FIXED_IN)


class _RecordingComm:
    """``deepspeed.comm`` for ``partition_parameters``: the same, except that the all-gathers started inside the
    wrapped ``_allgather_params_coalesced`` are remembered, to be waited for when it returns."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def _remember(self, handle: Any) -> Any:
        pending = getattr(_local, "pending", None)
        if pending is not None and handle is not None:
            pending.append(handle)
        return handle

    def all_gather(self, *args, **kwargs):
        return self._remember(self._comm.all_gather(*args, **kwargs))

    def all_gather_into_tensor(self, *args, **kwargs):
        return self._remember(self._comm.all_gather_into_tensor(*args, **kwargs))


def wait_every_gather(force: bool = False) -> bool:
    """Make ``Init._allgather_params_coalesced`` of this process wait for every all-gather it started before it
    returns. Does nothing (and returns False) on DeepSpeed :data:`FIXED_IN` and later, unless ``force``; returns True
    where it is in place. Idempotent; :func:`undo` restores DeepSpeed's method and module. Raises AttributeError where
    ``partition_parameters`` has no ``Init._allgather_params_coalesced`` or no ``dist`` (a DeepSpeed this was not
    written for)."""
    global _installed
    if _installed is not None:
        return True
    if not (force or needed()):
        return False
    from deepspeed.runtime.zero import partition_parameters as module

    original_comm = module.dist
    original = module.Init.__dict__["_allgather_params_coalesced"]

    def _allgather_params_coalesced(self, *args, **kwargs):
        global waited
        outer = getattr(_local, "pending", None)
        _local.pending = []
        try:
            return original(self, *args, **kwargs)
        finally:
            pending: List[Any] = _local.pending
            _local.pending = outer
            for handle in pending:
                handle.wait()
            waited += len(pending)

    def _undo() -> None:
        module.dist = original_comm
        module.Init._allgather_params_coalesced = original

    module.dist = _RecordingComm(original_comm)
    module.Init._allgather_params_coalesced = _allgather_params_coalesced
    _installed = _undo
    return True


def undo() -> None:
    """Restore what :func:`wait_every_gather` replaced (nothing when it is not in place)."""
    global _installed
    if _installed is not None:
        _installed()
        _installed = None
