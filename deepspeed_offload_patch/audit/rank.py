# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Inside each rank of ``ds-offload-patch audit``: host syncs counted per training phase and optimizer step.

The bootstrap ``sitecustomize`` calls :func:`install_from_environment` in every Python process of the audited
command. Once ``deepspeed.runtime.engine`` is imported, ``DeepSpeedEngine.forward``, ``backward`` and ``step`` are
wrapped (on the class, so engines that HF Trainer or Accelerate create are covered): each call runs under
:func:`~deepspeed_offload_patch.testing.count_host_syncs` and its count goes to one phase of the current optimizer step:

* ``forward``: the engine's forward passes;
* ``boundary_backward``: ``backward()`` of the micro-batch that ends a gradient accumulation (where ZeRO reduces the
  gradients and, with offload, checks them for inf/NaN);
* ``other_backward``: the other micro-batches' ``backward()``;
* ``step``: every ``step()`` call (the one at the boundary updates the parameters).

An optimizer step ends with the ``step()`` call that advances the engine's ``global_steps``. After ``steps`` of them, each rank writes
its report (``rank-<R>.json`` in the audit folder), rank 0 gathers every rank's and prints the table (on one node; on
several, the audit command prints the ranks whose reports reach its folder, with each node's and the total), and the wrappers stop counting (or, with ``stop_after``, the process exits 0 at once: see :func:`_stop`). A process that ends before that writes what it counted.
On CUDA, each call also runs under ``torch.profiler`` to count ``cuda*Synchronize`` calls, unless another profiler is
already running (then those counts are ``null``). Counting only observes: the ops run as they would without it.
"""

import atexit
import functools
import json
import os
import socket
import sys
import threading
from collections import Counter
from typing import Any, Callable, Dict, List, Optional

from deepspeed_offload_patch import import_hook, settings
from deepspeed_offload_patch.audit.report import PHASES, table
from deepspeed_offload_patch.log import rank_and_world

ENGINE_MODULE = "deepspeed.runtime.engine"
CUDA_SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
REPORT = "report.json"

_import_roots: Optional[List[str]] = None


def _short(where: str) -> str:
    """A source location relative to the import root it lies under (site-packages, a source checkout, the script's
    folder): ``deepspeed/runtime/zero/stage_1_and_2.py:1502 (...)``."""
    global _import_roots
    if _import_roots is None:
        roots = {os.path.abspath(p or os.curdir) for p in sys.path}
        _import_roots = sorted((r + os.sep for r in roots if os.path.isdir(r)), key=len, reverse=True)
    for root in _import_roots:
        if where.startswith(root):
            return where[len(root):]
    return where


def _node() -> Optional[int]:
    """This rank's node as its launcher numbers them: ``CROSS_RANK`` (the ``deepspeed`` launcher), ``GROUP_RANK``
    (``torchrun``), ``NODE_RANK``; None when none is set or a number."""
    for name in ("CROSS_RANK", "GROUP_RANK", "NODE_RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


class PhaseCounts:
    """One process's counts: a dict of phase counts per optimizer step, and the source lines behind them."""

    def __init__(self, steps: int, top: int):
        self.steps_wanted = steps
        self.top = top
        self.steps: List[Dict[str, int]] = []
        self.cuda_steps: List[Optional[Dict[str, int]]] = []
        self.lines: Dict[str, Counter] = {phase: Counter() for phase in PHASES}
        self.current = self._empty()
        self.current_cuda: Optional[Dict[str, int]] = None
        self.cuda_available = True
        self.calls = 0
        self.done = False
        self.local = threading.local()

    @staticmethod
    def _empty() -> Dict[str, int]:
        return {phase: 0 for phase in PHASES}

    def add(self, phase: str, events, cuda: Optional[Dict[str, int]]) -> None:
        self.calls += 1
        self.current[phase] += len(events)
        for op, where in events:
            self.lines[phase][(_short(where), op)] += 1
        if cuda is None:
            self.cuda_available = False
        elif self.cuda_available:
            self.current_cuda = self.current_cuda or self._empty()
            self.current_cuda[phase] += sum(cuda.values())

    def end_step(self) -> None:
        self.steps.append(self.current)
        self.cuda_steps.append(self.current_cuda)
        self.current = self._empty()
        self.current_cuda = None
        if len(self.steps) >= self.steps_wanted:
            self.done = True

    def report(self, rank: int, world_size: int, engine=None) -> Dict[str, Any]:
        """This process's numbers, as the audit's JSON holds them for each rank."""
        patch = sys.modules.get("deepspeed_offload_patch")
        deepspeed = sys.modules.get("deepspeed")
        cuda = self.cuda_available and any(c is not None for c in self.cuda_steps)
        return {
            "rank": rank,
            "world_size": world_size,
            "node": _node(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "deepspeed_version": getattr(deepspeed, "__version__", None),
            "patch_state": patch.status().state if patch is not None else "not-loaded",
            "device": str(getattr(engine, "device", "")) or None,
            "steps_wanted": self.steps_wanted,
            "complete": self.done,
            "steps": self.steps,
            "cuda_syncs": self.cuda_steps if cuda else None,
            "top": {
                phase: [{
                    "line": line,
                    "op": op,
                    "count": count
                } for (line, op), count in self.lines[phase].most_common(self.top)]
                for phase in PHASES
            },
        }


_state: Optional[PhaseCounts] = None
_written = False


def _profiler_running() -> bool:
    import torch
    enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
    return bool(enabled()) if enabled is not None else True


def _cuda_profiler():
    """A profiler of CUDA runtime calls, or None off CUDA. None too while another profiler runs: a second one starts
    without complaint, but records nothing and stops the first when it stops."""
    import torch
    if not torch.cuda.is_available() or _profiler_running():
        return None
    from torch.profiler import ProfilerActivity, profile
    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def _counted(phase_of: Callable[..., str], method: Callable) -> Callable:
    """``method`` wrapped so that each call's host syncs go to the phase ``phase_of(engine)`` names (decided before
    the call: ``backward()`` moves the micro-step counter). Nested engine calls count once."""
    from deepspeed_offload_patch.hostsync import count_host_syncs

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        state = _state
        if state is None or state.done or getattr(state.local, "active", False):
            return method(self, *args, **kwargs)
        phase = phase_of(self)
        steps_before = getattr(self, "global_steps", None)
        state.local.active = True
        cuda = None
        try:
            profiler = _cuda_profiler() if state.cuda_available else None
            if profiler is not None:
                profiler.__enter__()
            try:
                with count_host_syncs() as syncs:
                    result = method(self, *args, **kwargs)
            finally:
                if profiler is not None:
                    profiler.__exit__(None, None, None)
                    cuda = Counter()
                    for event in profiler.key_averages():
                        if event.key in CUDA_SYNC_EVENTS:
                            cuda[event.key] += event.count
        finally:
            state.local.active = False
        state.add(phase, syncs.events, dict(cuda) if cuda is not None else None)
        # An optimizer step ends when step() advances global_steps (skipped steps too, in every release).
        if phase == "step" and getattr(self, "global_steps", None) != steps_before:
            state.end_step()
            if state.done:
                try:
                    _finish(self)
                except Exception as exc:  # the audit must not end a training run (only --stop-after does)
                    from deepspeed_offload_patch.log import warn_once
                    warn_once(f"ds-offload-patch audit: this rank's report was not completed: {exc!r}")
        return result

    wrapper.__ds_offload_patch_audit__ = method
    return wrapper


def _backward_phase(engine) -> str:
    return "boundary_backward" if engine.is_gradient_accumulation_boundary() else "other_backward"


def _folder() -> str:
    return os.environ[settings.AUDIT_DIR]


def _write(name: str, data: Any) -> None:
    path = os.path.join(_folder(), name)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _gather(report: Dict[str, Any]) -> Optional[List[Dict[str, Any]]]:
    """Every rank's report on every rank (a collective: each rank calls it after the same optimizer step)."""
    comm = sys.modules.get("deepspeed.comm")
    if comm is None or not comm.is_initialized() or comm.get_world_size() == 1:
        return [report]
    gather = getattr(comm, "all_gather_object", None)
    if gather is None:
        # DeepSpeed before 0.17.1 has no all_gather_object in deepspeed.comm; its process group is torch's.
        import torch.distributed as torch_dist
        gather = torch_dist.all_gather_object
    reports: List[Any] = [None] * comm.get_world_size()
    gather(reports, report)
    return reports


def _single_node(world: int) -> bool:
    """Whether every rank runs on this node (the launcher's local size is the world size). Only then is every rank
    known to be audited: the ``deepspeed`` launcher does not pass ``DS_OFFLOAD_PATCH_AUDIT_*`` to other nodes, and a
    collective that only some ranks call would hang the run."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):  # torchrun and accelerate; the deepspeed launcher
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value) == world
    return world == 1


def _finish(engine) -> None:
    """The counted steps are done: write this rank's report; rank 0 prints every rank's; stop if asked."""
    global _written

    rank, world = rank_and_world()
    report = _state.report(rank, world, engine)
    _write(f"rank-{rank}.json", report)
    _written = True
    # On several nodes no collective: each rank's file stays on its node, and the audit command reports this node's.
    reports = _gather(report) if _single_node(world) else None
    if rank == 0 and reports is not None:
        _write(REPORT, {"ranks": reports})
        if os.environ.get(settings.AUDIT_PRINT) != "0":
            print(table(reports), flush=True)
    if os.environ.get(settings.AUDIT_STOP_AFTER) == "1":
        _stop(rank, world)


def _stop(rank: int, world: int) -> None:
    """End this rank now, exit code 0, after every rank of the node has its report written.

    The process leaves with ``os._exit``: an ordinary exit in the middle of training tears down the live process group
    in the interpreter's shutdown, and that aborted a rank now and then (``terminate called without an active
    exception``, SIGABRT, 1 run in 12 measured), which the launcher reports as a failed run. The cost: the training
    script's own ``atexit`` handlers and ``finally`` blocks do not run, which is what stopping it early means.
    """
    print(f"[ds-offload-patch audit] rank {rank}: stopping after {_state.steps_wanted} counted steps", flush=True)
    comm = sys.modules.get("deepspeed.comm")
    if _single_node(world) and comm is not None and comm.is_initialized() and comm.get_world_size() > 1:
        try:
            comm.barrier()  # no rank leaves while another is still in the report's collective
        except Exception as exc:
            print(f"[ds-offload-patch audit] rank {rank}: the barrier before stopping failed: {exc!r}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _at_exit() -> None:
    """A process that trained but ended before the counted steps were done still reports what it counted."""
    if _state is None or _written or _state.calls == 0:
        return
    rank, world = rank_and_world()
    try:
        _write(f"rank-{rank}.json", _state.report(rank, world))
    except OSError:
        pass


def instrument(module) -> None:
    """Wrap ``DeepSpeedEngine.forward/backward/step`` in ``module`` (``deepspeed.runtime.engine``) once."""
    engine_class = module.DeepSpeedEngine
    wrappers = {
        "forward": lambda engine: "forward",
        "backward": _backward_phase,
        "step": lambda engine: "step",
    }
    for name, phase_of in wrappers.items():
        original = engine_class.__dict__.get(name)
        if original is None or hasattr(original, "__ds_offload_patch_audit__"):
            continue
        setattr(engine_class, name, _counted(phase_of, original))


def install(steps: int = 3, top: int = 10) -> None:
    """Count the first ``steps`` optimizer steps of the DeepSpeed engines in this process (see the module doc).

    DeepSpeed is not imported here: the engine class is wrapped when ``deepspeed.runtime.engine`` is imported.
    """
    global _state
    if _state is not None:
        return
    _state = PhaseCounts(steps, top)
    atexit.register(_at_exit)
    import_hook.when_imported(ENGINE_MODULE, instrument)


def install_from_environment() -> bool:
    """:func:`install` when ``DS_OFFLOAD_PATCH_AUDIT_DIR`` is set (by ``ds-offload-patch audit``); returns whether it
    did. Bad numbers in the other variables fall back to the defaults."""
    if not os.environ.get(settings.AUDIT_DIR):
        return False

    def number(name: str, default: int) -> int:
        try:
            return max(1, int(os.environ.get(name, default)))
        except ValueError:
            return default

    install(steps=number(settings.AUDIT_STEPS, 3), top=number(settings.AUDIT_TOP, 10))
    return True
