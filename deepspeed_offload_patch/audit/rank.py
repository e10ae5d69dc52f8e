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

An optimizer step ends with the ``step()`` call that advances the engine's ``global_steps``.

Under the pipeline engine (``deepspeed.runtime.pipe.engine.PipelineEngine``, whose ``forward``, ``backward`` and
``step`` refuse to run) each ``train_batch()`` call is one optimizer step. It runs under one
``count_host_syncs()``, and the instructions it executes (the functions of ``PipelineEngine._INSTRUCTION_MAP``, which
``_exec_schedule`` calls; wrapped in that map, so the schedule and its results are unchanged) mark which of its host
syncs belong to which phase (:data:`~deepspeed_offload_patch.audit.report.PIPELINE_PHASES`):

* ``forward``: ``ForwardPass``;
* ``backward``: every ``BackwardPass`` (the micro-batches' backward; the pipeline turns the engine's all-reduce there
  off);
* ``reduce_grads``: ``ReduceTiedGrads`` and ``ReduceGrads``, the boundary's gradient reduction (ZeRO-1 reduces the
  gradients there and, with offload, checks them for inf/NaN: where the pipeline makes the syncs the patch removes);
* ``pipe_comm``: ``LoadMicroBatch`` and the sends and receives between stages;
* ``optimizer_step``: ``OptimizerStep``;
* ``other``: the rest of ``train_batch()`` (the loss's aggregation over the stages), and instructions of other types.

The engine's own wrappers do not count a pipeline engine's calls (``eval_batch()`` is not counted). The first kind of
engine to count in a process fixes its phases; the other kind is then not counted there. Under the pipeline there
are no ``cuda`` counts (``null``): one profiler per instruction was left out.

After ``steps`` optimizer steps, each rank writes
its report (``rank-<R>.json`` in the audit folder), rank 0 gathers every rank's and prints the table (on one node; on
several, the audit command prints the ranks whose reports reach its folder, with each node's and the total), and the wrappers stop counting (or, with ``stop_after``, the process exits 0 at once: see :func:`_stop`). A process that ends before that writes what it counted.
On CUDA, each call also runs under ``torch.profiler`` to count ``cuda*Synchronize`` calls, unless another profiler is
already running (then those counts are ``null``). Counting only observes: the ops run as they would without it.
"""

import atexit
import functools
import json
import os
import sys
from collections import Counter
from typing import Any, Callable, Dict, List, Optional

from deepspeed_offload_patch import import_hook, settings
from deepspeed_offload_patch.audit.counts import PhaseCounts
from deepspeed_offload_patch.audit.report import table
from deepspeed_offload_patch.log import rank_and_world

ENGINE_MODULE = "deepspeed.runtime.engine"
PIPE_MODULE = "deepspeed.runtime.pipe.engine"
#: The phase of each of the pipeline's instructions, by the name of its class in ``deepspeed.runtime.pipe.schedule``;
#: an instruction of another type counts in ``other``.
INSTRUCTION_PHASES = {
    "ForwardPass": "forward",
    "BackwardPass": "backward",
    "ReduceTiedGrads": "reduce_grads",
    "ReduceGrads": "reduce_grads",
    "LoadMicroBatch": "pipe_comm",
    "SendActivation": "pipe_comm",
    "RecvActivation": "pipe_comm",
    "SendGrad": "pipe_comm",
    "RecvGrad": "pipe_comm",
    "OptimizerStep": "optimizer_step",
}
CUDA_SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
REPORT = "report.json"

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
        if (state is None or state.done or getattr(state.local, "active", False) or _is_pipeline(self)
                or not state.claim("engine")):
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
            _end_step(state, self)
        return result

    wrapper.__ds_offload_patch_audit__ = method
    return wrapper


#: The pipeline engine classes :func:`instrument_pipeline` wrapped.
_pipeline_classes: List[type] = []


def _is_pipeline(engine) -> bool:
    """Whether ``engine`` is a ``PipelineEngine`` (counted per ``train_batch()``, not per engine call)."""
    return any(isinstance(engine, cls) for cls in _pipeline_classes)


def _end_step(state: PhaseCounts, engine) -> None:
    state.end_step()
    if state.done:
        try:
            _finish(engine)
        except Exception as exc:  # the audit must not end a training run (only --stop-after does)
            from deepspeed_offload_patch.log import warn_once
            warn_once(f"ds-offload-patch audit: this rank's report was not completed: {exc!r}")


def _counted_batch(method: Callable) -> Callable:
    """``PipelineEngine.train_batch`` wrapped: each call is one optimizer step, counted under one
    ``count_host_syncs()``; its host syncs go to the phases the instructions marked (:func:`_counted_instruction`),
    the rest to ``other``. A call that raises keeps its counts in the unfinished step (a process that ends there
    reports them) and ends no step."""
    from deepspeed_offload_patch.hostsync import count_host_syncs

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        state = _state
        if state is None or state.done or getattr(state.local, "active", False) or not state.claim("pipeline"):
            return method(self, *args, **kwargs)
        state.local.active = True
        marks: List[tuple] = []
        state.local.marks = marks
        finished = False
        syncs = None
        try:
            with count_host_syncs() as syncs:
                state.local.batch = syncs
                result = method(self, *args, **kwargs)
            finished = True
        finally:
            state.local.active = False
            state.local.batch = None
            state.local.marks = None
            events = syncs.events if syncs is not None else []
            phases = ["other"] * len(events)
            for phase, start, end in marks:
                phases[start:end] = [phase] * (end - start)
            for phase in state.phases:
                state.add(phase, [event for event, mine in zip(events, phases) if mine == phase], None)
        if finished:
            _end_step(state, self)
        return result

    wrapper.__ds_offload_patch_audit__ = method
    return wrapper


def _counted_instruction(phase: str, function: Callable) -> Callable:
    """One of ``PipelineEngine._INSTRUCTION_MAP``'s functions wrapped: inside a counted ``train_batch()``, the host
    syncs it makes (the events its call adds to the batch's counter) belong to ``phase``. It counts nothing itself:
    outside a counted ``train_batch()`` (``eval_batch()``, the steps after the counted ones) it only calls through."""

    @functools.wraps(function)
    def wrapper(self, *args, **kwargs):
        state = _state
        syncs = getattr(state.local, "batch", None) if state is not None else None
        if syncs is None or getattr(state.local, "instruction", False):
            return function(self, *args, **kwargs)
        start = len(syncs.events)
        state.local.instruction = True
        try:
            return function(self, *args, **kwargs)
        finally:
            state.local.instruction = False
            state.local.marks.append((phase, start, len(syncs.events)))

    wrapper.__ds_offload_patch_audit__ = function
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


def instrument_pipeline(module) -> None:
    """Wrap ``PipelineEngine.train_batch`` and the functions of its ``_INSTRUCTION_MAP`` in ``module``
    (``deepspeed.runtime.pipe.engine``) once. The map is changed in place: ``_exec_schedule`` looks each instruction
    up there, and subclasses that inherit it see the wrapped functions too."""
    engine_class = module.PipelineEngine
    if engine_class not in _pipeline_classes:
        _pipeline_classes.append(engine_class)
    original = engine_class.__dict__.get("train_batch")
    if original is not None and not hasattr(original, "__ds_offload_patch_audit__"):
        engine_class.train_batch = _counted_batch(original)
    table = engine_class.__dict__.get("_INSTRUCTION_MAP")
    if not isinstance(table, dict):
        return
    for kind, function in list(table.items()):
        if callable(function) and not hasattr(function, "__ds_offload_patch_audit__"):
            table[kind] = _counted_instruction(INSTRUCTION_PHASES.get(getattr(kind, "__name__", ""), "other"),
                                               function)


def install(steps: int = 3, top: int = 10) -> None:
    """Count the first ``steps`` optimizer steps of the DeepSpeed engines in this process (see the module doc).

    DeepSpeed is not imported here: the engine class is wrapped when ``deepspeed.runtime.engine`` is imported, the
    pipeline engine's when ``deepspeed.runtime.pipe.engine`` is.
    """
    global _state
    if _state is not None:
        return
    _state = PhaseCounts(steps, top)
    atexit.register(_at_exit)
    import_hook.when_imported(ENGINE_MODULE, instrument)
    import_hook.when_imported(PIPE_MODULE, instrument_pipeline)


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
