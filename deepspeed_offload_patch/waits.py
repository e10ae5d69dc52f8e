# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The host waits per tensor that an offloaded job makes on a GPU and that no change of this package removes: what a
setting or a DeepSpeed release removes instead. ``affected`` lists them beside the waits the changes remove (a
change's record says which kind of wait its defect is).

Each is read in DeepSpeed's source (``docs/gpu.md`` has the measured ones):

* a copy of a gradient into pageable host memory returns only once it is done, ``non_blocking`` or not (CUDA's
  documented behaviour): with ``offload_optimizer.pin_memory`` false, every gradient partition copied to the CPU
  stalls the host, per tensor at each boundary backward (and each micro-step of an accumulating ZeRO-2 job).
  ``pin_memory`` defaults to false up to 0.19.4 and to true from 0.19.5;
* ZeRO-3 up to 0.19.4 copies each partitioned gradient into the CPU optimizer's buffer with a blocking copy at the
  boundary (0.15.4 - 0.16.2: a staged copy and a device synchronize per tensor); 0.19.5 makes it non-blocking.
"""

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from packaging.version import Version

#: The kinds of host wait, each its own column in ``audit`` and ``bench``: a read of a tensor's value (``.item()``, an
#: ``if`` on a tensor), a wait on an event, on a stream, on the whole device, and a copy into host memory that
#: returns only once it is done.
READ, EVENT_WAIT, STREAM_WAIT, DEVICE_SYNC, BLOCKING_COPY = ("read", "event wait", "stream wait", "device sync",
                                                             "blocking copy")
KINDS = (READ, EVENT_WAIT, STREAM_WAIT, DEVICE_SYNC, BLOCKING_COPY)
#: The counter's names of the ops that are not reads (every other op it counts is a read).
COPY_OP = "device-to-host copy"
OFFLOAD_WAIT_OP = "ZeRO offload copy wait"
_KIND_OF = {
    COPY_OP: BLOCKING_COPY,
    "Event.synchronize": EVENT_WAIT,
    OFFLOAD_WAIT_OP: EVENT_WAIT,
    "Stream.synchronize": STREAM_WAIT,
    "synchronize": DEVICE_SYNC,
}


def kind_of(op: str) -> str:
    """The kind (one of :data:`KINDS`) of the host wait that the counter calls ``op``."""
    return _KIND_OF.get(op, READ)


YES, NO, MAYBE = "yes", "no", "maybe"
#: The first release whose ``offload_optimizer.pin_memory`` defaults to true.
PINNED_BY_DEFAULT = "0.19.5"
#: The first release whose ZeRO-3 copies each partitioned gradient to the CPU without blocking.
ZERO3_NON_BLOCKING = "0.19.5"


@dataclass(frozen=True)
class HostWait:
    """One host wait per tensor: its kind (:data:`deepspeed_offload_patch.hostsync.KINDS`), what and where it is,
    ``applies(job, release) -> (yes/no/maybe, why)``, and what removes it."""

    kind: str
    what: str
    applies: Callable[[Any, Optional[Version]], Tuple[str, str]]
    removed_by: str


def _pageable(job, release: Optional[Version]) -> Tuple[str, str]:
    if job.offload is None:
        return NO, "no offload_optimizer"
    if job.pin_memory is True:
        return NO, "pin_memory true"
    if job.pin_memory is False:
        return YES, "pin_memory false"
    if release is None:
        return MAYBE, "pin_memory unset: its default depends on the release"
    if release < Version(PINNED_BY_DEFAULT):
        return YES, f"pin_memory unset, false by default before {PINNED_BY_DEFAULT}"
    return NO, f"pin_memory unset, true by default from {PINNED_BY_DEFAULT}"


def _zero3_copies(job, release: Optional[Version]) -> Tuple[str, str]:
    if job.offload is None or job.stage not in (3, "auto"):
        return NO, "not ZeRO-3 with offload_optimizer"
    if release is not None and release >= Version(ZERO3_NON_BLOCKING):
        return NO, f"DeepSpeed {release} copies without blocking"
    maybe = MAYBE if job.stage == "auto" or release is None else YES
    return maybe, "ZeRO-3 with offload_optimizer up to 0.19.4"


WAITS = (
    HostWait(
        BLOCKING_COPY, "a copy of each gradient into pageable host memory, per tensor at each boundary "
        "backward (and each micro-step of an accumulating ZeRO-2 job)", _pageable,
        "offload_optimizer.pin_memory: true"),
    HostWait(
        BLOCKING_COPY, "ZeRO-3's copy of each partitioned gradient into the optimizer's CPU buffer, per tensor "
        "at the boundary (0.15.4 - 0.16.2: a device synchronize per tensor)", _zero3_copies,
        f"DeepSpeed {ZERO3_NON_BLOCKING} or later (no change of this package removes it yet)"),
)
