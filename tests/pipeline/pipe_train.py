# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""A tiny pipeline-parallel training run: DeepSpeed's ``PipelineEngine`` over a ``PipelineModule`` of Linear layers
split into 2 stages, on 4 ranks (2 stages x 2 data-parallel ranks), ZeRO-1 with the optimizer offloaded to the CPU,
``train_batch()`` with gradient accumulation.

Two ways in:

* :func:`trace_pipeline` runs on ranks that :func:`~deepspeed_offload_patch.testing.launch.run_distributed` spawned
  (``tests/pipeline/test_pipeline.py``): it trains each :class:`PipeRun` and returns, per optimizer step, the bits of
  the stage's parameters and fp32 master partitions, the skipped steps, the loss scale, the returned loss, and the
  host syncs counted in each of the pipeline's instructions (the backward passes, ``ReduceGrads``,
  ``ReduceTiedGrads``, ``OptimizerStep``).
* ``python pipe_train.py [--steps N] [--precision bf16|fp16]`` is a plain training script for a launcher
  (``deepspeed --num_gpus 4``, ``torchrun --nproc_per_node 4``), which ``ds-offload-patch audit`` runs.

Deterministic on the CPU (one thread per rank, seeded layers, inputs by step, micro-batch and data-parallel rank), so
patched and unpatched processes produce the same bits unless the code differs.
"""

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

STAGES = 2
WORLD = 4
HIDDEN = 8
LAYERS = 4  # Linear layers, 2 per stage: each stage owns 4 parameter tensors, 2 in each data-parallel partition
MICRO_BATCH = 2
#: The instructions whose host syncs the harness counts, by the name of their class in ``deepspeed.runtime.pipe.schedule``.
COUNTED = ("BackwardPass", "ReduceTiedGrads", "ReduceGrads", "OptimizerStep")


@dataclass(frozen=True)
class PipeRun:
    """One pipeline training run on 4 ranks: ``precision`` ``bf16`` (overflow check on) or ``fp16`` (dynamic loss
    scaling from ``2**initial_scale_power``); ``grad_accum`` micro-batches per ``train_batch()``; ``fault``:
    ``(step, micro-batch, global rank, value)``, element 0 of the gradient of the stage's parameter ``0`` set to
    ``value`` (``"inf"``, ``"nan"``) in that micro-batch's backward on that rank, or None."""

    name: str
    precision: str = "bf16"
    grad_accum: int = 2
    steps: int = 4
    fault: Optional[Tuple[int, int, int, str]] = None
    initial_scale_power: int = 8

    def config(self) -> Dict[str, Any]:
        from deepspeed_offload_patch.testing.models import ds_config

        return ds_config(stage=1,
                         dtype=self.precision,
                         grad_accum=self.grad_accum,
                         micro_batch=MICRO_BATCH,
                         initial_scale_power=self.initial_scale_power)


def _loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (output.float() - labels.float()).pow(2).mean()


def build(run: PipeRun, seed: int = 1234):
    """The engine of ``run`` on this rank (``deepspeed.comm`` initialized on :data:`WORLD` ranks): a
    ``PipelineModule`` of :data:`LAYERS` Linear layers with a ``Tanh`` after each, split into :data:`STAGES` stages of
    equally many Linear layers, the same initial parameters on every data-parallel rank of a stage."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from deepspeed_offload_patch.testing import allow_fp16_on_cpu

    if run.precision == "fp16":
        allow_fp16_on_cpu()
    torch.manual_seed(seed)
    layers: List[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh()]
    model = PipelineModule(layers=layers, num_stages=STAGES, loss_fn=_loss, partition_method="type:Linear")
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad],
                                           config=run.config())
    return engine


def _dtype(engine) -> torch.dtype:
    return torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else torch.float32


def batches(engine, step: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches of optimizer step ``step`` for this rank's data-parallel replica, as ``train_batch()``
    reads them: ``(inputs, labels)``; the first stage uses the inputs, the last the labels, so the ranks of one
    replica must see the same pairs (they are seeded by step, micro-batch and data-parallel id)."""
    dp = engine.grid.get_data_parallel_id()
    for micro in range(engine.gradient_accumulation_steps()):
        generator = torch.Generator().manual_seed(100_000 * step + 100 * micro + dp)
        x = torch.randn(MICRO_BATCH, HIDDEN, generator=generator)
        y = torch.randn(MICRO_BATCH, HIDDEN, generator=generator)
        yield x.to(_dtype(engine)), y.to(_dtype(engine))


class _Fault:
    """A gradient hook on the stage's first parameter that poisons the backward of one micro-batch of one step."""

    def __init__(self, engine, run: PipeRun):
        self.step = -1
        self.micro = 0
        self.target = None
        if run.fault is not None and run.fault[2] == engine.global_rank:
            self.target = run.fault
            next(engine.module.parameters()).register_hook(self._hook)

    def start(self, step: int) -> None:
        self.step, self.micro = step, 0

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        step, micro, _, value = self.target
        hit = self.step == step and self.micro == micro
        self.micro += 1  # the schedule runs each micro-batch's backward once, in order
        if not hit:
            return grad
        grad = grad.clone(memory_format=torch.contiguous_format)
        grad.view(-1)[0] = float(value)
        return grad


class _InstructionSyncs:
    """Host syncs counted in the pipeline's instructions named in :data:`COUNTED`, while in use: each one's function
    in ``PipelineEngine._INSTRUCTION_MAP`` runs under ``count_host_syncs(device="cpu")`` and adds its count to the
    instruction's name. The map's functions are put back on exit (the harness must leave DeepSpeed as it found it)."""

    def __enter__(self) -> "_InstructionSyncs":
        from deepspeed.runtime.pipe.engine import PipelineEngine

        from deepspeed_offload_patch.hostsync import READ, count_host_syncs

        self.counts: Dict[str, int] = {}
        self.table = PipelineEngine._INSTRUCTION_MAP
        self.saved = dict(self.table)

        def counted(name, function):

            def run(engine, **kwargs):
                with count_host_syncs(device="cpu", kinds=(READ, )) as syncs:
                    result = function(engine, **kwargs)
                self.counts[name] = self.counts.get(name, 0) + syncs.total
                return result

            return run

        for kind, function in self.saved.items():
            if kind.__name__ in COUNTED:
                self.table[kind] = counted(kind.__name__, function)
        return self

    def take(self) -> Dict[str, int]:
        """The counts since the last call, every counted instruction named (0 where it made none)."""
        found = {name: self.counts.get(name, 0) for name in COUNTED}
        self.counts = {}
        return found

    def __exit__(self, *exc) -> None:
        self.table.clear()
        self.table.update(self.saved)


def _train(run: PipeRun) -> Dict[str, Any]:
    import deepspeed.comm as dist

    from deepspeed_offload_patch.testing.equivalence import _record, _typed

    started = time.perf_counter()
    engine = build(run)
    fault = _Fault(engine, run)
    trace: Dict[str, Any] = {"stage": engine.stage_id, "dp": engine.grid.get_data_parallel_id(), "steps": []}
    with _InstructionSyncs() as syncs:
        for step in range(run.steps):
            fault.start(step)
            loss = engine.train_batch(data_iter=batches(engine, step))
            record = _record(engine, step)
            record["loss"] = _typed(loss)
            # Not compared between sides (they differ by design): what the patch removes, per instruction.
            record["boundary_syncs"] = syncs.take()
            trace["steps"].append(record)
    trace["groups"] = {
        "data_parallel": list(dist.get_all_ranks_from_group(engine.optimizer.dp_process_group)),
        "pipe": list(dist.get_all_ranks_from_group(engine.grid.get_pipe_parallel_group())),
    }
    trace["optimizer"] = type(engine.optimizer).__name__
    trace["seconds"] = time.perf_counter() - started  # engine built and trained, this rank
    destroy = getattr(engine, "destroy", None)
    if callable(destroy):
        destroy()
    return trace


def trace_pipeline(runs: Tuple[PipeRun, ...]) -> Dict[str, Any]:
    """Train ``runs`` on this rank (``deepspeed.comm`` initialized on 4 ranks) and return the patch's state and each
    run's trace (see the module doc), in the shape :func:`~deepspeed_offload_patch.testing.equivalence.differences`
    compares."""
    import warnings

    import deepspeed_offload_patch

    warnings.simplefilter("ignore", FutureWarning)
    return {"state": deepspeed_offload_patch.status().state, "runs": {run.name: _train(run) for run in runs}}


def main(argv: Optional[List[str]] = None) -> int:
    """The launcher's entry: train ``--steps`` optimizer steps with ``train_batch()`` and print rank 0's losses."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher; unused")
    args = parser.parse_args(argv)

    from deepspeed_offload_patch.testing.launch import init_deepspeed_comm

    torch.set_num_threads(1)
    init_deepspeed_comm()
    run = PipeRun("script", precision=args.precision, steps=args.steps)
    engine = build(run)
    for step in range(run.steps):
        loss = engine.train_batch(data_iter=batches(engine, step))
        if engine.global_rank == 0:
            print(f"step {step}: loss {loss.item():.6f}, skipped {engine.skipped_steps}", flush=True)
    import deepspeed.comm as dist

    dist.destroy_process_group()  # a rank that exits with its process group alive can abort on a busy machine
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
