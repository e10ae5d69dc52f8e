# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Host synchronizations seen at PyTorch's dispatcher: the one mechanism the guard's probe, the audit, ``verify``, the
benchmark and the test helpers count with. Of this package it imports only the names of the kinds of wait
(:mod:`deepspeed_offload_patch.waits`).

* :func:`count_host_syncs` counts the host's waits for the device by op and by kind (:data:`KINDS`: reads of tensor
  values, event waits, stream waits, device syncs, blocking copies), with the Python line of each.
* :func:`no_host_sync` raises :class:`HostSyncError` at the first one.
* :class:`RaisingBoolTensor` is a tensor whose truth value cannot be taken, to feed through code under test.

``torch.cuda.set_sync_debug_mode`` only exists for CUDA; these work wherever PyTorch's dispatcher runs, including
inside autograd hooks (DeepSpeed reduces gradients in backward hooks). They are thread-local, like PyTorch's modes:
the autograd engine carries them into its worker threads.

Which reads count depends on where the run's tensors live (``device``). On the CPU accelerator the CPU stands in for
the device: every read counts, as the tests need. On an accelerator only reads of tensors on it (and blocking copies
from it into host memory) count: reading a CPU tensor there waits for nothing.

Waits that do not read a value are counted by wrapping, while counting, the calls that make them: on CUDA
``torch.cuda.Event.synchronize``, ``torch.cuda.Stream.synchronize`` and ``torch.cuda.synchronize``. The CPU
accelerator makes them no-ops (its events are None), so on the CPU the points where DeepSpeed would wait are counted
instead (:data:`_CPU_WAIT_POINTS`): its accelerator's ``synchronize()``, and ZeRO-1/2's ``_wait_for_offload_copies``
once an offload copy was recorded since the last one (DeepSpeed 0.19.8). That keeps the structure (a wait per tensor,
or per backward) visible to the CPU suite. These wrappers are process-wide while a counter is open, unlike the
dispatch modes: a wait in any thread counts.
"""

import contextlib
import os
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# The kinds of host wait (re-exported): defined beside the waits that affected lists, where torch is not imported.
from deepspeed_offload_patch.waits import (BLOCKING_COPY, COPY_OP, DEVICE_SYNC, EVENT_WAIT, KINDS, OFFLOAD_WAIT_OP,
                                           READ, STREAM_WAIT, kind_of)

__all__ = [
    "HostSyncError", "HostSyncCounter", "RaisingBoolTensor", "count_host_syncs", "no_host_sync", "on_the_cpu",
    "run_device_type", "kind_of", "KINDS", "READ", "EVENT_WAIT", "STREAM_WAIT", "DEVICE_SYNC", "BLOCKING_COPY"
]

aten = torch.ops.aten

# Ops that hand a tensor's value to the host: on an accelerator each one waits for the device.
_READ_OPS = {
    aten._local_scalar_dense.default: "aten._local_scalar_dense",
    aten.is_nonzero.default: "aten.is_nonzero",
    aten.item.default: "aten.item",
    aten.equal.default: "aten.equal",
}
# Ops whose output size depends on device data: a sync on accelerators, free on the CPU.
_DATA_DEPENDENT_OPS = {
    aten.nonzero.default: "aten.nonzero",
    aten.masked_select.default: "aten.masked_select",
}
_SKIP_FILES = (os.path.dirname(torch.__file__), os.path.abspath(__file__), contextlib.__file__)

#: Where DeepSpeed waits on a device whose waits the CPU accelerator makes no-ops: ``(module, class, the method that
#: records a copy, the method that waits, the op it counts as)``. A wait counts only when a copy was recorded on the
#: same object since its last wait: with nothing recorded the GPU's wait has nothing to wait for.
_CPU_WAIT_POINTS = (("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "_record_offload_copy",
                     "_wait_for_offload_copies", OFFLOAD_WAIT_OP), )

#: The objects (by id) that recorded a copy since their last wait, kept across counters: a backward counted by one
#: counter and the ``step()`` that waits for its copies counted by the next still make a wait. What happens while no
#: counter is open is not seen: a copy recorded then is missed, and a wait then clears nothing (so count the waits
#: that follow counted copies, ``step()`` included, to keep the next count exact).
_RECORDED: Dict[Tuple[str, str], set] = {}


class HostSyncError(RuntimeError):
    """Raised by :func:`no_host_sync` at a host wait it refuses, and by :class:`RaisingBoolTensor` when a device value
    is read on the host."""


def _caller() -> str:
    """The innermost Python line outside PyTorch and this module: the code that asked for the host read."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_SKIP_FILES):
            return f"{frame.filename}:{frame.lineno} ({frame.line})"
    return "<unknown>"


def _device_type(value) -> Optional[str]:
    return value.device.type if isinstance(value, torch.Tensor) else None


def _blocking_device_to_host(func, args, kwargs) -> bool:
    """A copy from an accelerator into host memory that the host waits for.

    ``tensor.to("cpu", non_blocking=True)`` does not wait (PyTorch gives it pinned memory). ``dst.copy_(src,
    non_blocking=True)`` waits anyway when ``dst`` is not pinned: a copy into pageable memory returns only once it is
    complete (CUDA's documented behaviour), whatever ``non_blocking`` asks.
    """
    if func is aten._to_copy.default:
        target = kwargs.get("device")
        source = _device_type(args[0])
        return (target is not None and torch.device(target).type == "cpu" and source not in (None, "cpu", "meta")
                and not kwargs.get("non_blocking", False))
    if func is aten.copy_.default:
        if _device_type(args[0]) != "cpu" or _device_type(args[1]) in (None, "cpu", "meta"):
            return False
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return not non_blocking or not args[0].is_pinned()
    return False


def _on(value, device: str) -> bool:
    """Whether ``value`` is a tensor whose reads count when the run's tensors live on ``device`` (a type)."""
    kind = _device_type(value)
    return kind is not None and (device == "cpu" or kind == device)


def _classify(func, args, kwargs, device: str) -> Optional[str]:
    """The name of the host read ``func`` performs that counts for a run on ``device``, or None."""
    if func in _READ_OPS:
        return _READ_OPS[func] if any(_on(arg, device) for arg in args[:2]) else None
    if func in _DATA_DEPENDENT_OPS and _device_type(args[0]) not in ("cpu", "meta"):
        return _DATA_DEPENDENT_OPS[func]
    if _blocking_device_to_host(func, args, kwargs):
        return COPY_OP
    return None


def run_device_type() -> str:
    """The device type the run's tensors live on: DeepSpeed's accelerator once DeepSpeed has loaded it (never
    importing DeepSpeed), else PyTorch's current accelerator, else ``cpu``."""
    import sys
    accelerator = sys.modules.get("deepspeed.accelerator")
    if accelerator is not None:
        try:
            return torch.device(accelerator.get_accelerator().device_name()).type
        except Exception:  # a half-imported DeepSpeed: fall back to PyTorch's view
            pass
    current = getattr(getattr(torch, "accelerator", None), "current_accelerator", None)
    found = current() if current is not None else None
    if found is None and torch.cuda.is_available():
        return "cuda"
    return found.type if found is not None else "cpu"


@dataclass
class HostSyncCounter:
    """What :func:`count_host_syncs` saw: counts by op, and each event as ``(op, python line)``."""

    counts: Counter = field(default_factory=Counter)
    events: List[Tuple[str, str]] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Every host wait, of every kind."""
        return sum(self.counts.values())

    @property
    def by_kind(self) -> Dict[str, int]:
        """``{kind: count}`` for every kind of :data:`KINDS`, in that order (0 where none was seen)."""
        found = dict.fromkeys(KINDS, 0)
        for op, count in self.counts.items():
            found[kind_of(op)] += count
        return found

    @property
    def reads(self) -> int:
        """The reads of tensor values alone (the kind that the upstream change takes off the boundary backward)."""
        return self.by_kind[READ]


class _DispatchWatch(TorchDispatchMode):

    def __init__(self, on_sync: Callable[[str], None], device: str):
        super().__init__()
        self._on_sync = on_sync
        self._device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _classify(func, args, kwargs, self._device)
        if op is not None:
            self._on_sync(op)
        return func(*args, **kwargs)


class _FunctionWatch(TorchFunctionMode):
    """``Tensor.tolist`` and ``Tensor.numpy`` read CPU tensors without reaching the dispatcher: catch them here."""

    _METHODS = {torch.Tensor.tolist: "Tensor.tolist", torch.Tensor.numpy: "Tensor.numpy"}

    def __init__(self, on_sync: Callable[[str], None], device: str):
        super().__init__()
        self._on_sync = on_sync
        self._device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._METHODS and args and _on(args[0], self._device):
            self._on_sync(self._METHODS[func])
        return func(*args, **(kwargs or {}))


def _counting(owner, name: str, op: str, on_sync: Callable[[str], None], stack: contextlib.ExitStack) -> None:
    """Replace ``owner.name`` with a wrapper that reports ``op`` and calls it, until ``stack`` closes."""
    original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if original is None:
        return

    def counted(*args, **kwargs):
        on_sync(op)
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    stack.callback(setattr, owner, name, original)


def _count_cpu_wait_points(on_sync: Callable[[str], None], stack: contextlib.ExitStack) -> None:
    """On the CPU accelerator: count its ``synchronize()`` and DeepSpeed's offload-copy waits (module docstring).
    Reads only modules already imported: counting never imports DeepSpeed."""
    import sys
    accelerator = sys.modules.get("deepspeed.accelerator")
    if accelerator is not None:
        try:
            _counting(type(accelerator.get_accelerator()), "synchronize", "synchronize", on_sync, stack)
        except Exception:  # a half-imported DeepSpeed: nothing of it to count
            pass
    for module_name, class_name, record, wait, op in _CPU_WAIT_POINTS:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is None or wait not in cls.__dict__ or record not in cls.__dict__:
            continue
        recorded = _RECORDED.setdefault((module_name, class_name), set())
        original_wait, original_record = cls.__dict__[wait], cls.__dict__[record]

        def counted_wait(self, *args, _original=original_wait, _recorded=recorded, _op=op, **kwargs):
            if id(self) in _recorded:
                on_sync(_op)
            _recorded.discard(id(self))
            return _original(self, *args, **kwargs)

        def counted_record(self, *args, _original=original_record, _recorded=recorded, **kwargs):
            _recorded.add(id(self))
            return _original(self, *args, **kwargs)

        for name, replacement, original in ((record, counted_record, original_record), (wait, counted_wait,
                                                                                        original_wait)):
            setattr(cls, name, replacement)
            stack.callback(setattr, cls, name, original)


def _count_waits(on_sync: Callable[[str], None], device: str, stack: contextlib.ExitStack) -> None:
    """Wrap, until ``stack`` closes, the calls that make the host wait without reading a value."""
    if device == "cpu":
        _count_cpu_wait_points(on_sync, stack)
        return
    if device == "cuda":
        _counting(torch.cuda.Event, "synchronize", "Event.synchronize", on_sync, stack)
        _counting(torch.cuda.Stream, "synchronize", "Stream.synchronize", on_sync, stack)
        _counting(torch.cuda, "synchronize", "synchronize", on_sync, stack)


@contextlib.contextmanager
def _watch(on_sync: Callable[[str], None], cuda_mode: Optional[str], device: Optional[str],
           kinds: Sequence[str]) -> Iterator[None]:
    device = torch.device(device).type if device is not None else run_device_type()
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"no such kind of host wait: {sorted(unknown)} (kinds: {', '.join(KINDS)})")
    wanted = on_sync

    def on_sync(op: str) -> None:
        if kind_of(op) in kinds:
            wanted(op)

    previous = None
    if cuda_mode is not None and torch.cuda.is_available():
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(cuda_mode)
    try:
        with contextlib.ExitStack() as stack:
            if set(kinds) - {READ, BLOCKING_COPY}:  # the waits that no op of the dispatcher shows
                _count_waits(on_sync, device, stack)
            with _FunctionWatch(on_sync, device), _DispatchWatch(on_sync, device):
                yield
    finally:
        if previous is not None:
            torch.cuda.set_sync_debug_mode(previous)


@contextlib.contextmanager
def count_host_syncs(device: Optional[str] = None, kinds: Sequence[str] = KINDS) -> Iterator[HostSyncCounter]:
    """Count the host's waits for the device inside the block, by op, with the Python line of each
    (:attr:`HostSyncCounter.by_kind` sorts them into :data:`KINDS`).

    Reads: ``aten._local_scalar_dense`` (what ``.item()``, ``bool()``, ``int()``, ``float()`` and a tensor in an
    ``if`` reduce to), ``aten.is_nonzero``, ``aten.item``, ``aten.equal``, ``Tensor.tolist``/``numpy``, and on
    accelerators data-dependent ops (``nonzero``, ``masked_select``). Blocking copies (accelerators): a copy into host
    memory that returns once it is done, which is any copy into pageable memory, ``non_blocking`` or not. Event,
    stream and device waits: see the module's docstring (on the CPU, DeepSpeed's own wait points).

    ``device`` is where the run's tensors live (a device or its type; default :func:`run_device_type`). ``cpu``
    counts every read, of any tensor; an accelerator counts reads of tensors on that accelerator only. ``kinds``:
    the kinds counted (default all; ``(READ, )`` for the reads alone, what the upstream change is about).
    Raises ValueError for a kind not in :data:`KINDS`.
    """
    counter = HostSyncCounter()

    def record(op: str) -> None:
        counter.counts[op] += 1
        counter.events.append((op, _caller()))

    with _watch(record, cuda_mode=None, device=device, kinds=kinds):
        yield counter


@contextlib.contextmanager
def no_host_sync(device: Optional[str] = None, kinds: Sequence[str] = KINDS) -> Iterator[None]:
    """Raise :class:`HostSyncError` at the first host wait inside the block of one of ``kinds`` (default every kind;
    see :func:`count_host_syncs` for what counts, ``device`` and ``kinds``). The message names the op and the Python
    line. On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is also on inside the block, whatever ``kinds`` says
    (an op it flags raises its RuntimeError), and restored after it.
    """

    def fail(op: str) -> None:
        raise HostSyncError(f"host synchronization: {op} at {_caller()}")

    with _watch(fail, cuda_mode="error", device=device, kinds=kinds):
        yield


class RaisingBoolTensor(torch.Tensor):
    """A tensor whose truth value cannot be taken: ``bool(t)``, ``if t:``, ``t and x`` raise :class:`HostSyncError`.

    Make one with ``RaisingBoolTensor.wrap(tensor)`` (no copy). Results of ops on it are RaisingBoolTensors too, so
    anything derived from it keeps the property: feed it where a device flag flows (for example as the result of
    DeepSpeed's ``_has_inf_or_nan``) and any ``if`` on the flag fails loudly. ``.item()`` still works: that is an
    explicit, visible read. ``plain(t)`` gives back an ordinary tensor view.
    """

    @staticmethod
    def wrap(tensor: torch.Tensor) -> "RaisingBoolTensor":
        return tensor.as_subclass(RaisingBoolTensor)

    @staticmethod
    def plain(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.as_subclass(torch.Tensor)

    def __bool__(self):
        raise HostSyncError(f"truth value of a device flag taken on the host at {_caller()}")


class _OnTheCpu(TorchFunctionMode):
    """Maps every device argument of a torch call to the CPU, and ``Tensor.cuda()`` to no move at all."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if isinstance(arg, (str, torch.device)) else arg for arg in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_the_cpu() -> Iterator[None]:
    """Keep every tensor that code creates or moves inside the block on the CPU, whatever device it names.

    For trying code on throwaway inputs (the guard's probe of an unknown tracker) without touching an accelerator.
    Device names that code asks for (``get_accelerator().current_device_name()``) are still computed.
    """
    with _OnTheCpu():
        yield
