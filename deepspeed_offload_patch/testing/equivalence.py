# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Train the same runs with and without the patch, in separate processes, and compare them bit for bit.

A :class:`Run` is a small ZeRO-1/2 training run with the optimizer offloaded to the CPU: stage, accumulation (and its
dtype), precision, ZeRO options, model, the ranks and their groups (world size, model-parallel size), and the
:class:`Fault` s (inf or NaN gradients) it injects. :func:`run_side` trains
runs on spawned ranks with the patch on (``patched``) or off (``unpatched``) and returns each rank's trace: the
overflow flag before every boundary ``step()`` (read on the host, where the check is on), and after every optimizer
step the bits of the model's parameters and of the fp32 master partitions, the skipped-step count,
``optimizer.overflow`` and the loss scale state, each with its Python type, and the host syncs counted in the boundary
backward. :func:`differences` lists where two traces differ (the sync counts aside: they differ by design); an empty
list means the runs were bit-identical. :func:`boundary_syncs` reads the counts.

Everything is deterministic on the CPU (one thread per rank, seeded model, inputs by step and rank), so two
processes running the same code produce the same bits; a difference means the code differed.
"""

import gc
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from deepspeed_offload_patch import settings
from deepspeed_offload_patch.changes import OTHERS
from deepspeed_offload_patch.hostsync import READ, count_host_syncs
from deepspeed_offload_patch.states import State
from deepspeed_offload_patch.testing.installed import flag_is_read, has_defect, per_param_tracker
from deepspeed_offload_patch.testing.launch import HANG_GUARD_S, run_distributed
from deepspeed_offload_patch.testing.models import (ManyLinear, ModelParallelGroups, SometimesUnused, WithExperts,
                                                    batch, ds_config, make_engine, optimizer_step)

__all__ = [
    "BUFFER_OFF", "CLEARED_AFTER_SKIP", "CURRENT", "PATCHED", "UNPATCHED", "UPSTREAM_ONLY", "Fault", "Run",
    "backward_to_boundary", "bad_gradients_survive", "boundary_syncs", "differences", "fault_problems", "flag_is_read",
    "overflow_sticks", "invalid_norm_skips_step", "per_param_tracker", "poison_grad", "poison_plan",
    "ranks_agree_on_overflow", "reference_side", "run_side", "skips_in", "TRAINING_FIXED", "training_fixes",
    "set_full_grad_reaches_tracker", "trace_runs", "zenflow_available"
]

PATCHED = "patched"
UNPATCHED = "unpatched"
#: The patch as this process's ``DS_OFFLOAD_PATCH_DISABLE`` says (the red/green run disables it), the rest as the sides.
CURRENT = "current"
#: Unpatched DeepSpeed with its compact fp32 gradient partition buffer turned off (0.19.8 accumulates into it with
#: fp32 ``grad_accum_dtype``): the reference for the skipped-step fix. Without a fault, buffer on and off train the
#: same bits; with one, the buffer keeps the skipped step's inf/NaN and this side does not.
BUFFER_OFF = "unpatched-buffer-off"
#: Unpatched DeepSpeed whose compact gradient buffers the harness zeroes after each skipped step: the skipped-step
#: fix's specification, written independently. The reference at ZeRO-2, where turning the buffer off changes the bits
#: even without a fault (measured on 0.19.8: the fp32 master partitions differ from the first step), so that
#: :data:`BUFFER_OFF` is a sound reference at ZeRO-1 only.
CLEARED_AFTER_SKIP = "unpatched-cleared-after-skip"
#: Unpatched DeepSpeed with only the changes that correct training installed by the harness (``corrects_training``:
#: the accumulation fixes and the invalid-norm fix, where the release has their defects): the reference for the runs
#: that reach those defects (ZeRO-2 over 3 or more micro-steps; an fp32 fault), whose bits the package changes on
#: purpose there (the oracle, :mod:`deepspeed_offload_patch.testing.oracle`, and the forced-skip reference of
#: :mod:`deepspeed_offload_patch.testing.skips` prove them right). Where no such change applies it is unpatched
#: DeepSpeed.
TRAINING_FIXED = "unpatched-training-fixed"
#: Only the upstream pull request's change (``DS_OFFLOAD_PATCH_UPSTREAM_ONLY=1``).
UPSTREAM_ONLY = "upstream-only"
#: Read in each rank of the harness: ``0`` turns DeepSpeed's compact gradient partition buffer off.
COMPACT_BUFFER = "DS_OFFLOAD_TEST_COMPACT_BUFFER"
#: Read in each rank of the harness: ``1`` zeroes the compact gradient buffers after each skipped step.
CLEAR_AFTER_SKIP = "DS_OFFLOAD_TEST_CLEAR_AFTER_SKIP"
#: Read in each rank of the harness: ``1`` installs the changes that correct training on DeepSpeed's class itself (the
#: package disabled).
FIX_TRAINING = "DS_OFFLOAD_TEST_FIX_TRAINING"
# Every change on (each by its own switch), nothing else set.
_SWITCHES = {
    settings.DISABLE: "0",
    settings.STRICT: "0",
    **{
        change.switch: "1"
        for change in OTHERS
    },
    settings.UPSTREAM_ONLY: "0",
    COMPACT_BUFFER: "1",
    CLEAR_AFTER_SKIP: "0",
    FIX_TRAINING: "0",
}
#: Each side's switches, whatever the calling process has: the sides must differ in the patch and nothing else.
SIDE_ENV = {
    PATCHED: dict(_SWITCHES),
    UNPATCHED: dict(_SWITCHES, **{settings.DISABLE: "1"}),
    BUFFER_OFF: dict(_SWITCHES, **{
        settings.DISABLE: "1",
        COMPACT_BUFFER: "0"
    }),
    CLEARED_AFTER_SKIP: dict(_SWITCHES, **{
        settings.DISABLE: "1",
        CLEAR_AFTER_SKIP: "1"
    }),
    TRAINING_FIXED: dict(_SWITCHES, **{
        settings.DISABLE: "1",
        FIX_TRAINING: "1"
    }),
    UPSTREAM_ONLY: dict(_SWITCHES, **{settings.UPSTREAM_ONLY: "1"}),
}
PRECISIONS = ("bf16", "bf16-nocheck", "fp32", "fp16")
MODELS = ("plain", "sometimes-unused", "param-groups", "moe")
GRAD_ACCUM_DTYPES = (None, "fp32")
FAULT_PATHS = ("grad", "set-cpu", "set-device")
CHECKPOINT_TAG = "mid"


@dataclass(frozen=True)
class Fault:
    """A bad gradient at optimizer step ``step``: ``value`` is ``"nan"``, ``"inf"`` or ``"-inf"``.

    ``via="grad"``: element 0 of the gradient that backward produces for parameter number ``param``, at micro-step
    ``micro`` (``None``: the boundary), on rank ``rank`` (``None``: every rank). ``via="set-cpu"`` or
    ``"set-device"``: after the boundary backward, ``safe_set_full_grad`` with a gradient full of ``value``, as a CPU
    or an accelerator tensor, for the first parameter whose partition the rank holds.

    Where DeepSpeed does not all-reduce the offload flag over data-parallel ranks (0.17.x under ZeRO-1), a one-rank
    fault makes the ranks disagree and abort, patched or not; there the fault goes to every parameter on every rank.
    """

    step: int
    value: str = "nan"
    rank: Optional[int] = 0
    micro: Optional[int] = None
    param: int = 0
    via: str = "grad"

    def __post_init__(self):
        if self.via not in FAULT_PATHS:
            raise ValueError(f"via must be one of {FAULT_PATHS}, not {self.via!r}")
        if not math.isnan(float(self.value)) and not math.isinf(float(self.value)):
            raise ValueError(f"a fault's value is nan, inf or -inf, not {self.value!r}")


@dataclass(frozen=True)
class Run:
    """One training run on every rank. ``precision``: ``bf16`` (overflow check on), ``bf16-nocheck``, ``fp32`` or
    ``fp16`` (dynamic loss scaling from ``2**initial_scale_power``);
    ``model``: ``plain``, ``sometimes-unused`` (a side layer only even micro-steps use, one layer never used) or
    ``param-groups`` (two optimizer groups) or ``moe`` (a mixture-of-experts layer with expert parallelism 2,
    :class:`~deepspeed_offload_patch.testing.models.WithExperts`). ``grad_accum_dtype``: ``None`` (the precision's)
    or ``"fp32"``. ``world_size`` ranks; ``model_parallel`` > 1 splits them into Megatron-shaped model-parallel and
    data-parallel groups (:class:`~deepspeed_offload_patch.testing.models.ModelParallelGroups`) passed as ``mpu``.
    ``zenflow`` trains with DeepSpeed's ZenFlow optimizer (ZeRO-2, its CPU Adam). ``save_after``: save a checkpoint
    after that many steps when :func:`trace_runs` is given a ``save_root``."""

    name: str
    stage: int = 2
    grad_accum: int = 1
    precision: str = "bf16"
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    model: str = "plain"
    zenflow: bool = False
    steps: int = 5
    faults: Tuple[Fault, ...] = ()
    save_after: Optional[int] = None
    num_tensors: int = 12
    initial_scale_power: int = 8
    grad_accum_dtype: Optional[str] = None
    world_size: int = 2
    model_parallel: int = 1

    def __post_init__(self):
        if self.precision not in PRECISIONS or self.model not in MODELS or self.grad_accum_dtype not in GRAD_ACCUM_DTYPES:
            raise ValueError(f"{self.name}: precision in {PRECISIONS}, model in {MODELS}, grad_accum_dtype in "
                             f"{GRAD_ACCUM_DTYPES}")
        if self.world_size % self.model_parallel or (self.model == "moe" and self.world_size % 2):
            raise ValueError(f"{self.name}: {self.world_size} ranks do not split into model-parallel groups of "
                             f"{self.model_parallel} (or expert-parallel groups of 2)")

    @property
    def skips_bad_steps(self) -> bool:
        """Whether DeepSpeed itself skips a step with an inf/NaN gradient here: fp16 does; bf16 with the check on does
        where its flag is read (:func:`flag_is_read`); bf16 with it off does not (the bad values reach the
        parameters); fp32 runs with the check off and skips only where :func:`invalid_norm_skips_step` (0.19.8 and
        later). Processes with the invalid-norm fix installed skip in fp32 too: :func:`skips_in` asks them."""
        if self.precision == "fp32" and not self.zenflow:
            return invalid_norm_skips_step()
        return self.precision in ("bf16", "fp16") and flag_is_read(self.precision)

    @property
    def unchecked(self) -> bool:
        """Whether the run's steps get no overflow check from DeepSpeed, so that only an invalid gradient norm can
        make them skip: fp32, and bf16 before 0.17.1 (which has no check to turn on). ZenFlow steps on its own."""
        return not self.zenflow and (self.precision == "fp32" or
                                     (self.precision.startswith("bf16") and per_param_tracker()))

    def config(self) -> Dict[str, Any]:
        config = ds_config(stage=self.stage,
                           dtype=self.precision.split("-")[0],
                           initial_scale_power=self.initial_scale_power,
                           check_grad_overflow=self.precision == "bf16",
                           grad_accum=self.grad_accum,
                           overlap_comm=self.overlap_comm,
                           contiguous_gradients=self.contiguous_gradients,
                           reduce_scatter=self.reduce_scatter,
                           grad_accum_dtype=self.grad_accum_dtype)
        if self.zenflow:
            # ZenFlow steps with its own CPU Adam (built on first use) and sets accumulation to update_interval.
            config["zero_optimization"]["zenflow"] = {
                "topk_ratio": 0.5,
                "select_strategy": "step",
                "select_interval": 2,
                "update_interval": 2,
                "full_warm_up_rounds": 0,
                "overlap_step": False,
            }
            del config["optimizer"]["params"]["torch_adam"]
            config["zero_force_ds_cpu_optimizer"] = True
        return config


def overflow_sticks(run: Run, result: Optional[Sequence[Dict[str, Any]]] = None) -> bool:
    """Whether the first skipped step of ``run`` makes every later step overflow too: on the installed DeepSpeed,
    or, given a :func:`run_side` ``result``, in the processes that trained it.

    With gradients accumulated in fp32 under bf16 or fp16 (``grad_accum_dtype``), releases that accumulate into a
    compact fp32 partition buffer (``DeepSpeedZeroOptimizer._use_compact_grad_partition_buffer``, 0.19.8) keep the
    inf or NaN in that buffer when the step is skipped with the optimizer offloaded: measured on 0.19.8, ZeRO-1 and
    ZeRO-2, where the buffer is off an inf at step 1 skips step 1 only. The skipped-step fix drops the buffer (its
    state is in each rank's result), as does the :data:`BUFFER_OFF` side.
    """
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    separate = run.grad_accum_dtype == "fp32" and run.precision != "fp32"
    if not (separate and run.skips_bad_steps
            and hasattr(DeepSpeedZeroOptimizer, "_use_compact_grad_partition_buffer")):
        return False
    if result is None:
        return True
    rank = result[0]
    return (rank.get("compact_buffer", True) and not rank.get("cleared_after_skip")
            and rank.get("skipped_step") not in (State.APPLIED, State.UPSTREAM_FIXED))


def training_fixes(run: Run) -> List[str]:
    """The changes that correct training (``corrects_training``) which change ``run`` on the installed DeepSpeed,
    by name: the accumulation fix at ZeRO-2 over 3 or more micro-steps where the release drops micro-batches; the
    invalid-norm fix where an unchecked step (:attr:`Run.unchecked`) gets a bad gradient and DeepSpeed applies it
    (NaN weights, 0.17.1 - 0.19.7; 0.14.0 - 0.17.0 crash there, so their runs inject no such fault)."""
    found = []
    if run.stage == 2 and run.grad_accum >= 3 and has_defect("grad-accumulation"):
        found.append("grad-accumulation")
    if run.faults and run.unchecked and has_defect("invalid-norm"):
        found.append("invalid-norm")
    return found


def skips_in(run: Run, result: Sequence[Dict[str, Any]]) -> bool:
    """Whether the processes of a :func:`run_side` ``result`` skip a step of ``run`` with an inf/NaN gradient:
    DeepSpeed's own skip (:attr:`Run.skips_bad_steps`), or an unchecked step where those processes had the
    invalid-norm fix installed (the patched side by default, :data:`TRAINING_FIXED`)."""
    return run.skips_bad_steps or (run.unchecked and bool(result[0].get("unchecked_steps_skip")))


def reference_side(run: Run) -> str:
    """The side that the patched processes must train ``run`` bit-identically to: :data:`UNPATCHED`, except where
    the skipped-step fix changes the run (a fault, and DeepSpeed keeping it in its compact buffer): there unpatched
    DeepSpeed without that defect, :data:`BUFFER_OFF` at ZeRO-1 and :data:`CLEARED_AFTER_SKIP` at ZeRO-2; and where a
    change that corrects training reaches the run (:func:`training_fixes`; at ZeRO-2 over 3 or more micro-steps
    always), :data:`TRAINING_FIXED`."""
    if run.faults and overflow_sticks(run):
        return BUFFER_OFF if run.stage == 1 else CLEARED_AFTER_SKIP
    # ZeRO-2 accumulating over 3 or more micro-steps: where DeepSpeed drops the ones between (0.15.2 - 0.18.x), the
    # package's fix changes the bits on purpose; elsewhere TRAINING_FIXED trains as UNPATCHED does.
    if (run.stage == 2 and run.grad_accum >= 3) or training_fixes(run):
        return TRAINING_FIXED
    return UNPATCHED


def invalid_norm_skips_step() -> bool:
    """Whether the installed DeepSpeed's ``step()`` also treats an inf/NaN gradient norm as overflow when the dtype
    is not bf16 or the check is on (DeepSpeed 0.19.8 and later). There a tracker that misses an overflow still
    skips the step."""
    import deepspeed
    from packaging.version import Version

    from deepspeed_offload_patch.guard import release_of

    return release_of(deepspeed.__version__) >= Version("0.19.8")


def bad_gradients_survive(precision: str) -> bool:
    """Whether the installed DeepSpeed's ``step()`` survives an inf/NaN gradient in ``precision``, patched or not.

    DeepSpeed 0.14.0 to 0.17.0 do not where they do not read the flag (bf16, fp32): their offload gradient norm
    turns into the integer -1, and ``step()`` fails on it in ``torch.linalg.vector_norm``. Tests inject faults only
    where DeepSpeed survives them.
    """
    return flag_is_read(precision) or not per_param_tracker()


def set_full_grad_reaches_tracker() -> bool:
    """Whether ``safe_set_full_grad`` passes the gradient it sets through the overflow tracker (0.17.1 and later;
    0.14.0 has no ``safe_set_full_grad``, and up to 0.17.0 it bypasses the tracker)."""
    return not per_param_tracker()


def zenflow_available() -> bool:
    """Whether the installed DeepSpeed has ZenFlow (0.17.6 and later)."""
    import importlib.util
    return importlib.util.find_spec("deepspeed.runtime.zenflow") is not None


def ranks_agree_on_overflow(zero_stage: int) -> bool:
    """Whether DeepSpeed all-reduces the offload overflow flag over data-parallel ranks at this stage.

    DeepSpeed 0.17.1 to 0.17.6 do so only when gradients are partitioned (ZeRO-2). Under ZeRO-1, an overflow that
    only one rank's partition sees makes the ranks disagree, and their collectives then abort, patched or not (fixed
    upstream in 0.18.0; before 0.17.1, ``step()`` always passed the all-reducing default; the patch keeps each
    release's behaviour).
    """
    import deepspeed
    from packaging.version import Version

    from deepspeed_offload_patch.guard import release_of

    release = release_of(deepspeed.__version__)
    return zero_stage == 2 or not Version("0.17.1") <= release < Version("0.18.0")


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().view(torch.uint8).clone()


def _typed(value: Any) -> Tuple[str, Any]:
    """``(type name, value)``; a float as its repr, so that NaN equals NaN; a tensor with its dtype."""
    if torch.is_tensor(value):
        return (f"Tensor[{value.dtype}]", repr(value.tolist()))
    if isinstance(value, float):
        return ("float", repr(value))
    return (type(value).__name__, value)


def _scaler_state(optimizer) -> Dict[str, Tuple[str, Any]]:
    scaler = getattr(optimizer, "loss_scaler", None)
    fields = vars(scaler) if scaler is not None else {}
    state = {k: _typed(v) for k, v in sorted(fields.items()) if isinstance(v, (bool, int, float, torch.Tensor))}
    state["loss_scale"] = _typed(optimizer.loss_scale)
    return state


def _params(engine) -> Dict[str, torch.Tensor]:
    return {name: _bits(p) for name, p in engine.module.named_parameters()}


def _record(engine, step: int) -> Dict[str, Any]:
    optimizer = engine.optimizer
    return {
        "step": step,
        "params": _params(engine),
        "master": [_bits(t) for t in optimizer.single_partition_of_fp32_groups],
        "nan_params": sorted(n for n, p in engine.module.named_parameters() if not torch.isfinite(p).all()),
        "skipped": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "overflow": _typed(optimizer.overflow),
        # What get_global_grad_norm() returns and clipping divides by: the on-device gradient norm must give the same.
        "grad_norm": _typed(engine.get_global_grad_norm()),
        "scale": _scaler_state(optimizer),
    }


def _build(run: Run):
    model_class = {"sometimes-unused": SometimesUnused, "moe": WithExperts}.get(run.model, ManyLinear)
    mpu = ModelParallelGroups(run.model_parallel) if run.model_parallel > 1 else None
    return make_engine(run.num_tensors,
                       config=run.config(),
                       model_class=model_class,
                       groups=run.model == "param-groups",
                       mpu=mpu)


def _fault_ranks(run: Run, fault: Fault) -> List[int]:
    from deepspeed import comm as dist

    if fault.rank is None or not ranks_agree_on_overflow(run.stage):
        return list(range(dist.get_world_size()))
    return [fault.rank]


def poison_grad(param: torch.nn.Parameter, value: float):
    """Put ``value`` into element 0 of ``param``'s next gradient on this rank; returns the hook handle."""

    def hook(grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # some releases hand over strided gradients
        grad.view(-1)[0] = value
        return grad

    return param.register_hook(hook)


def poison_plan(engine, zero_stage: int, param: torch.nn.Parameter, rank: int) -> Tuple[list, List[int]]:
    """``(parameters, ranks)`` for a bad value in ``param`` on ``rank``: that alone where the ranks agree on overflow
    (:func:`ranks_agree_on_overflow`); otherwise every parameter on every rank, so that every rank's partition sees a
    bad value."""
    from deepspeed import comm as dist

    if ranks_agree_on_overflow(zero_stage):
        return [param], [rank]
    return list(engine.module.parameters()), list(range(dist.get_world_size()))


def backward_to_boundary(engine, step: int, poison=(), ranks=(), value: float = float("inf")) -> None:
    """The micro-steps of optimizer step ``step`` (inputs by :func:`batch`), each but the last followed by
    ``step()``, up to and including the boundary backward; there the gradients of the ``poison`` parameters get
    ``value`` on ``ranks``. The caller steps (or inspects the flag first)."""
    from deepspeed import comm as dist

    accum = engine.gradient_accumulation_steps()
    for micro in range(accum):
        boundary = micro == accum - 1
        handles = [poison_grad(p, value) for p in poison] if boundary and dist.get_rank() in ranks else []
        engine.backward(engine(batch(engine, step * 10 + micro)))
        for handle in handles:
            handle.remove()
        if not boundary:
            optimizer_step(engine)


def _grad_fault(engine, run: Run, fault: Fault) -> list:
    from deepspeed import comm as dist

    param = list(engine.module.parameters())[fault.param]
    if fault.rank is None:
        targets, ranks = [param], list(range(dist.get_world_size()))
    else:
        targets, ranks = poison_plan(engine, run.stage, param, fault.rank)
    return [poison_grad(p, float(fault.value)) for p in targets] if dist.get_rank() in ranks else []


def _set_fault(engine, run: Run, fault: Fault) -> None:
    from deepspeed import comm as dist
    from deepspeed.utils import safe_set_full_grad

    if dist.get_rank() not in _fault_ranks(run, fault):
        return
    target = next(p for p in engine.module.parameters() if getattr(p, "_hp_mapping", None) is not None)
    device = "cpu" if fault.via == "set-cpu" else engine.device
    safe_set_full_grad(target, torch.full(target.shape, float(fault.value), dtype=torch.float32, device=device))


def _flag(optimizer) -> Any:
    """The overflow flag as ``step()`` will read it, as a host bool; ``"unread"`` where ``step()`` does not read it
    (there the patch leaves the flag alone and unpatched DeepSpeed sets it for nothing)."""
    if hasattr(optimizer, "check_grad_overflow"):
        read = optimizer.check_grad_overflow
    else:  # 0.14.0 to 0.17.0: fp16 only
        read = optimizer.dtype == torch.float16
    if not read:
        return "unread"
    return bool(optimizer.local_overflow)


def _train_step(engine, run: Run, step: int) -> Tuple[Any, int]:
    """One optimizer step: every micro-step's forward, backward and ``step()``, with this step's faults. Returns
    the overflow flag just before the boundary ``step()`` and the host syncs counted in the boundary backward."""
    accum = engine.gradient_accumulation_steps()
    flag = syncs = None
    faults = [f for f in run.faults if f.step == step]
    for micro in range(accum):
        boundary = micro == accum - 1
        handles = []
        for fault in faults:
            if fault.via == "grad" and (accum - 1 if fault.micro is None else fault.micro) == micro:
                handles += _grad_fault(engine, run, fault)
        inputs = [batch(engine, step * accum + micro)]
        if run.model == "sometimes-unused":
            inputs.append((step + micro) % 2 == 0)
        loss = engine(*inputs)
        if boundary:
            with count_host_syncs(device="cpu", kinds=(READ, )) as counter:
                engine.backward(loss)
            syncs = counter.total
        else:
            engine.backward(loss)
        for handle in handles:
            handle.remove()
        if boundary:
            for fault in faults:
                if fault.via != "grad":
                    _set_fault(engine, run, fault)
            flag = _flag(engine.optimizer)
        optimizer_step(engine)
        if boundary and os.environ.get(CLEAR_AFTER_SKIP) == "1" and getattr(engine.optimizer, "overflow", False):
            _zero_compact_buffers(engine.optimizer)
    return flag, syncs


def _zero_compact_buffers(optimizer) -> None:
    """What a skipped step must leave behind, written from the outside: no gradient in a compact buffer."""
    for group in getattr(optimizer, "averaged_gradients", {}).values():
        flat = getattr(group, "flat_partition", None)
        if flat is not None:
            flat.zero_()


def _groups(optimizer) -> Dict[str, Any]:
    """The ranks ZeRO reduces each param group over (expert groups differ from dense ones) and the model-parallel
    group ``has_overflow()`` all-reduces over (``None`` without an ``mpu``)."""
    from deepspeed import comm as dist

    model_parallel = getattr(optimizer, "model_parallel_group", None)
    return {
        "data_parallel": [list(dist.get_all_ranks_from_group(group)) for group in optimizer.real_dp_process_group],
        "model_parallel": list(dist.get_all_ranks_from_group(model_parallel)) if model_parallel is not None else None,
    }


def _train(run: Run, save_dir: Optional[str], load_dir: Optional[str]) -> Dict[str, Any]:
    started = time.perf_counter()
    engine = _build(run)
    first = 0
    if load_dir is not None:
        _, client = engine.load_checkpoint(load_dir, tag=CHECKPOINT_TAG)
        first = client["next_step"]
    trace = {"initial": _params(engine), "first": first, "steps": []}
    for step in range(first, run.steps):
        flag, syncs = _train_step(engine, run, step)
        trace["steps"].append({"flag": flag, "boundary_syncs": syncs, **_record(engine, step)})
        if save_dir is not None and run.save_after == step + 1:
            engine.save_checkpoint(save_dir, tag=CHECKPOINT_TAG, client_state={"next_step": step + 1})
    trace["optimizer"] = type(engine.optimizer).__name__
    trace["groups"] = _groups(engine.optimizer)
    trace["seconds"] = time.perf_counter() - started  # engine built and trained, this rank
    destroy = getattr(engine, "destroy", None)
    if callable(destroy):
        destroy()
    del engine
    gc.collect()
    return trace


def method_origins() -> Dict[str, str]:
    """The module each of the upstream change's methods of ``DeepSpeedZeroOptimizer`` comes from right now."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from deepspeed_offload_patch.changes import UPSTREAM

    return {
        name: getattr(DeepSpeedZeroOptimizer.__dict__[name], "__module__", "?")
        for name in UPSTREAM.form_for(DeepSpeedZeroOptimizer).methods
    }


def _fix_training_only() -> None:
    """Install, on DeepSpeed's own classes, the replacements of the changes that correct training, where their guard
    would apply them (the package itself disabled): :data:`TRAINING_FIXED`'s DeepSpeed."""
    import importlib

    import deepspeed

    from deepspeed_offload_patch.changes import CHANGES

    for change in CHANGES:
        if change.corrects_training:
            cls = getattr(importlib.import_module(change.target.module), change.target.name)
            decision = change.decide(change, cls, deepspeed.__version__)
            for name, function in decision.replacements.items():
                setattr(cls, name, function)


def _unchecked_steps_skip() -> bool:
    """Whether this process skips an offloaded step that no overflow check looked at when its gradient norm is
    invalid: DeepSpeed's own (0.19.8), or the invalid-norm fix's methods installed on DeepSpeed's class (by the
    package or by :func:`_fix_training_only`)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from deepspeed_offload_patch.changes import by_name

    if invalid_norm_skips_step():
        return True
    change = by_name("invalid-norm")
    module = change.methods().__name__
    return all(
        getattr(DeepSpeedZeroOptimizer.__dict__.get(name), "__module__", None) == module
        for name in change.form_for(DeepSpeedZeroOptimizer).methods)


def trace_runs(runs: Sequence[Run],
               setup: Optional[Callable[[], None]] = None,
               save_root: Optional[str] = None,
               load_root: Optional[str] = None) -> Dict[str, Any]:
    """Train ``runs`` on this rank (``deepspeed.comm`` initialized) and return their traces, by run name.

    ``setup()`` runs first (after the package's import has applied the patch, or not). With ``save_root``, a run
    with ``save_after`` saves a checkpoint under ``save_root/<run name>``. With ``load_root``, each run is also
    resumed from ``load_root/<run name>`` and its trace from there is under ``"resumed"``.
    """
    import deepspeed_offload_patch

    warnings.simplefilter("ignore", FutureWarning)  # torch's notes on the collectives DeepSpeed calls
    if load_root:
        # DeepSpeed before 0.16 loads its checkpoints with torch.load's default, which from torch 2.6 refuses the loss
        # scaler object DeepSpeed saved (weights_only). These are checkpoints this run's own ranks wrote.
        os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    if os.environ.get(COMPACT_BUFFER) == "0":
        _turn_compact_buffer_off()
    if os.environ.get(FIX_TRAINING) == "1":
        _fix_training_only()
    if setup is not None:
        setup()
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    status = deepspeed_offload_patch.status()
    result: Dict[str, Any] = {
        "state":
        status.state,
        "skipped_step":
        status.skipped_step,
        "compact_buffer":
        os.environ.get(COMPACT_BUFFER) != "0"
        and hasattr(DeepSpeedZeroOptimizer, "_use_compact_grad_partition_buffer"),
        "cleared_after_skip":
        os.environ.get(CLEAR_AFTER_SKIP) == "1",
        "unchecked_steps_skip":
        _unchecked_steps_skip(),
        "methods":
        method_origins(),
        "runs": {},
        "resumed": {}
    }
    for run in runs:
        save_dir = os.path.join(save_root, run.name) if save_root and run.save_after else None
        result["runs"][run.name] = _train(run, save_dir, None)
        if load_root:
            result["resumed"][run.name] = _train(run, None, os.path.join(load_root, run.name))
    return result


def _turn_compact_buffer_off() -> None:
    """Make DeepSpeed accumulate fp32 gradients as it did before 0.19.8 (no compact partition buffer)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if hasattr(DeepSpeedZeroOptimizer, "_use_compact_grad_partition_buffer"):
        DeepSpeedZeroOptimizer._use_compact_grad_partition_buffer = lambda self, group_idx: False


def side_env(side: str) -> Dict[str, str]:
    """The switches of a side's processes: :data:`PATCHED` and :data:`UNPATCHED` whatever this process has;
    :data:`CURRENT` takes ``DS_OFFLOAD_PATCH_DISABLE`` from this process (so a test on it fails with the patch
    disabled, as the red/green run needs) and the rest from the patched side."""
    if side == CURRENT:
        return dict(SIDE_ENV[PATCHED], **{settings.DISABLE: os.environ.get(settings.DISABLE, "0")})
    return dict(SIDE_ENV[side])


def both_sides(train: Callable[[str], Any], current: Any) -> Dict[str, Any]:
    """``{PATCHED: ..., UNPATCHED: ...}``: ``train(side)`` in patched and in unpatched processes. ``current``, the
    result of ``train(CURRENT)``, is reused as the patched side when this process's switch leaves the patch on."""
    patched = current if side_env(CURRENT) == side_env(PATCHED) else train(PATCHED)
    return {PATCHED: patched, UNPATCHED: train(UNPATCHED)}


def run_side(side: str,
             runs: Sequence[Run],
             setup: Optional[Callable[[], None]] = None,
             save_root: Optional[str] = None,
             load_root: Optional[str] = None,
             world_size: Optional[int] = None,
             timeout: float = HANG_GUARD_S) -> List[Dict[str, Any]]:
    """:func:`trace_runs` on fresh ranks with the patch on (``PATCHED``), off (``UNPATCHED``, ``BUFFER_OFF``), with
    only the upstream change (``UPSTREAM_ONLY``) or as this process's switch says (``CURRENT``); returns each rank's
    result. The ranks are the runs' ``world_size`` (all runs must share
    it), or ``world_size`` where given. ``setup`` must pickle (a module-level function). The ranks come from the
    fork server (``run_distributed(fork_server=True)``): call it from a test process (pytest), not from a script or
    module whose ``__main__`` imports this package (each rank imports the caller's ``__main__`` before it takes this
    call's environment, so the package there would read the switches of the fork server's first caller).

    Raises:
        ValueError: the runs ask for different world sizes.
        DistributedFailure: a rank failed or hung (see :func:`~deepspeed_offload_patch.testing.launch.run_distributed`).
    """
    sizes = {run.world_size for run in runs} if world_size is None else {world_size}
    if len(sizes) != 1:
        raise ValueError(f"the runs of one side share a world size, not {sorted(sizes)}")
    return run_distributed(trace_runs,
                           sizes.pop(),
                           args=(tuple(runs), setup, save_root, load_root),
                           env=side_env(side),
                           timeout=timeout,
                           fork_server=True)


def boundary_syncs(result: Sequence[Dict[str, Any]], run: str) -> List[List[int]]:
    """The host syncs counted in each boundary backward of run ``run``, per rank, per step (a :func:`run_side`
    result)."""
    return [[step["boundary_syncs"] for step in rank["runs"][run]["steps"]] for rank in result]


def fault_problems(run: Run, result: Sequence[Dict[str, Any]]) -> List[str]:
    """Whether the faults of ``run`` did what they should on every rank of ``result`` (not a vacuous comparison):
    runs that skip bad steps there (:func:`skips_in`) skipped exactly their faulty steps and hold no NaN; the
    others trained through them and the NaN of the last step reached the parameters; runs without faults skipped
    nothing. ZenFlow skips steps of its own on the CPU, patched or not: its faulty steps must be among them. Where
    :func:`overflow_sticks`, every step from the first faulty one is skipped. Returns what did not hold, per rank."""
    problems = []
    fault_steps = sorted({fault.step for fault in run.faults})
    if fault_steps and overflow_sticks(run, result):
        fault_steps = list(range(fault_steps[0], run.steps))
    for number, rank in enumerate(result):
        steps = rank["runs"][run.name]["steps"]
        where = f"rank {number}, {run.name}"
        if skips_in(run, result):
            counts = [0] + [s["skipped"] for s in steps]
            skipped = [s["step"] for s, before in zip(steps, counts) if s["skipped"] > before]
            if run.zenflow:
                if not set(fault_steps) <= set(skipped):
                    problems.append(f"{where}: skipped {skipped}, faults at {fault_steps}")
            elif skipped != fault_steps or any(s["nan_params"] for s in steps):
                problems.append(f"{where}: skipped {skipped}, faults at {fault_steps}, NaN in "
                                f"{[s['nan_params'] for s in steps]}")
        elif run.faults:
            if steps[-1]["skipped"] != 0 or not steps[-1]["nan_params"]:
                problems.append(f"{where}: the NaN at the last step should reach the parameters, none skipped")
        elif steps[-1]["skipped"] != 0 or steps[-1]["nan_params"]:
            problems.append(f"{where}: no fault, yet skipped {steps[-1]['skipped']}, NaN in {steps[-1]['nan_params']}")
    return problems


def _step_differences(where: str, a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    found = []
    for key in sorted((set(a) | set(b)) - {"boundary_syncs"}):  # the syncs differ by design
        left, right = a.get(key), b.get(key)
        if key == "params":
            changed = sorted(n for n in left if n not in right or not torch.equal(left[n], right[n]))
            if changed:
                found.append(f"{where}: parameters differ: {', '.join(changed[:4])}")
        elif key == "master":
            if len(left) != len(right) or any(not torch.equal(x, y) for x, y in zip(left, right)):
                found.append(f"{where}: fp32 master partitions differ")
        elif left != right:
            found.append(f"{where}: {key} {left!r} != {right!r}")
    return found


def differences(a: Sequence[Dict[str, Any]],
                b: Sequence[Dict[str, Any]],
                run: str,
                part: str = "runs",
                b_part: Optional[str] = None,
                from_step: int = 0) -> List[str]:
    """Where run ``run`` differs between results ``a`` and ``b`` of :func:`run_side` (per rank, per step); empty when
    bit-identical. ``part``/``b_part`` pick ``"runs"`` or ``"resumed"``; steps before ``from_step`` are ignored."""
    found = []
    for rank, (left, right) in enumerate(zip(a, b)):
        steps_a = [s for s in left[part][run]["steps"] if s["step"] >= from_step]
        steps_b = [s for s in right[b_part or part][run]["steps"] if s["step"] >= from_step]
        if [s["step"] for s in steps_a] != [s["step"] for s in steps_b]:
            found.append(f"rank {rank}: different steps recorded")
            continue
        for step_a, step_b in zip(steps_a, steps_b):
            found += _step_differences(f"rank {rank}, {run}, step {step_a['step']}", step_a, step_b)
    return found
