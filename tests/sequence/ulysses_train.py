# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""A tiny sequence-parallel training run: DeepSpeed's Ulysses (``deepspeed.sequence.layer.DistributedAttention``)
over a sequence-parallel group of 2 ranks, ZeRO-2 with the optimizer offloaded to the CPU, gloo on the CPU.

Each rank holds half of every sequence (``[batch, seq / 2, hidden]``). The model is 2 blocks of attention and a
Linear layer; in each block the q, k and v projections (4 heads) go through ``DistributedAttention``, whose
all-to-all (``all_to_all_single`` on gloo) trades the sequence split for a head split, so the local attention sees the
whole sequence for half of the heads, and a second all-to-all trades them back. The groups are DeepSpeed's own
``mpu`` for Ulysses, ``deepspeed.runtime.sequence_parallel.parallel_state_sp`` (sequence-parallel group [0, 1], and
ZeRO partitions and reduces over the sequence-data-parallel group, also [0, 1]), passed to ``deepspeed.initialize``
as a user's script does.

:func:`trace_ulysses` runs on ranks that :func:`~deepspeed_offload_patch.testing.launch.run_distributed` spawned
(``test_ulysses.py``): before training it checks that the sequence-parallel attention equals the whole sequence's
attention computed on one rank; then it trains each :class:`UlyssesRun` and returns, per optimizer step, what
:func:`~deepspeed_offload_patch.testing.equivalence.differences` compares (parameters, fp32 master partitions,
skipped steps, loss scale, gradient norm, ``optimizer.overflow``, the overflow flag before ``step()``), the loss, and
the host syncs counted in the boundary backward.

Deterministic on the CPU (one thread per rank, seeded model, inputs by step and micro-batch, the same whole sequence
on both ranks), so patched and unpatched processes produce the same bits unless the code differs.
"""

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

SEQUENCE_PARALLEL = 2
WORLD = 2
HIDDEN = 16
HEADS = 4
HEAD_DIM = HIDDEN // HEADS
SEQUENCE = 8  # the whole sequence; each rank holds SEQUENCE // SEQUENCE_PARALLEL positions
MICRO_BATCH = 2
BLOCKS = 2


@dataclass(frozen=True)
class UlyssesRun:
    """One run on 2 ranks: ZeRO ``stage`` with offload, ``precision`` ``bf16`` (overflow check on) or ``fp16``
    (dynamic loss scaling from ``2**8``), ``grad_accum`` micro-batches per step, ``steps`` optimizer steps;
    ``fault``: ``(step, micro-batch, rank, value, parameter number)``, element 0 of that parameter's gradient set to
    ``value`` (``"inf"``, ``"nan"``) in that micro-batch's backward on that rank, or None."""

    name: str
    precision: str = "bf16"
    stage: int = 2
    grad_accum: int = 2
    steps: int = 4
    fault: Optional[Tuple[int, int, int, str, int]] = None

    def config(self) -> Dict[str, Any]:
        from deepspeed_offload_patch.testing.models import ds_config

        return ds_config(stage=self.stage, dtype=self.precision, grad_accum=self.grad_accum, micro_batch=MICRO_BATCH)


class LocalAttention(torch.nn.Module):
    """Scaled dot-product attention over ``[batch, sequence, heads, head_dim]`` tensors (no mask); keeps the shape of
    the last query it saw, so a test can tell the whole sequence reached it."""

    def __init__(self):
        super().__init__()
        self.seen: Tuple[int, ...] = ()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        self.seen = tuple(query.shape)
        out = torch.nn.functional.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2),
                                                               value.transpose(1, 2))
        return out.transpose(1, 2)


class Block(torch.nn.Module):
    """x + o(attention(q(x), k(x), v(x))), then x + tanh(mlp(x)); ``attention`` is Ulysses's ``DistributedAttention``
    around a :class:`LocalAttention`."""

    def __init__(self, attention: torch.nn.Module):
        super().__init__()
        self.q, self.k, self.v, self.o, self.mlp = (torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(5))
        self.attention = attention

    def heads(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = (x.shape[0], x.shape[1], HEADS, HEAD_DIM)
        return self.q(x).view(shape), self.k(x).view(shape), self.v(x).view(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # batch_dim_idx 0: the tensors are [batch, sequence, heads, head_dim].
        context = self.attention(*self.heads(x), 0)
        x = x + self.o(context.reshape(x.shape))
        return x + torch.tanh(self.mlp(x))


class UlyssesModel(torch.nn.Module):
    """:data:`BLOCKS` blocks whose attention runs over ``group`` (the sequence-parallel group); the loss is the mean
    square of this rank's part of the output."""

    def __init__(self, group):
        from deepspeed.sequence.layer import DistributedAttention

        super().__init__()
        self.blocks = torch.nn.ModuleList(
            Block(DistributedAttention(LocalAttention(), group, scatter_idx=2, gather_idx=1)) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.float().pow(2).mean()


def sequence_parallel_mpu():
    """DeepSpeed's Ulysses ``mpu`` with its groups made (once per process: it keeps them in module globals and
    refuses a second ``initialize_sequence_parallel``)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    try:
        mpu.get_sequence_parallel_group()
    except AssertionError:  # not made yet
        mpu.initialize_sequence_parallel(SEQUENCE_PARALLEL)
    return mpu


def _dtype(engine) -> torch.dtype:
    return torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else torch.float32


def whole_sequence(engine, step: int, micro: int) -> torch.Tensor:
    """The whole input sequence of micro-batch ``micro`` of step ``step`` (the same on every rank)."""
    generator = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(MICRO_BATCH, SEQUENCE, HIDDEN, generator=generator).to(engine.device, _dtype(engine))


def my_part(x: torch.Tensor, rank: int) -> torch.Tensor:
    """The positions of the sequence that sequence-parallel rank ``rank`` holds (contiguous halves)."""
    local = x.shape[1] // SEQUENCE_PARALLEL
    return x[:, rank * local:(rank + 1) * local].contiguous()


def build(run: UlyssesRun, seed: int = 1234):
    """The engine of ``run`` (``deepspeed.comm`` initialized on :data:`WORLD` ranks), the same initial parameters on
    both ranks, with DeepSpeed's sequence-parallel ``mpu``."""
    import deepspeed

    from deepspeed_offload_patch.testing import allow_fp16_on_cpu

    if run.precision == "fp16":
        allow_fp16_on_cpu()
    mpu = sequence_parallel_mpu()
    torch.manual_seed(seed)
    model = UlyssesModel(mpu.get_sequence_parallel_group())
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model.parameters(),
                                           config=run.config(),
                                           mpu=mpu)
    return engine


def attention_check(engine) -> Dict[str, Any]:
    """The first block's sequence-parallel attention on step 0's input against the same attention over the whole
    sequence and all heads on this rank alone (no all-to-all): the largest difference on this rank's positions, and
    the shape the local attention saw (the whole sequence, half the heads)."""
    from deepspeed.utils import groups

    rank = groups._get_sequence_parallel_rank()
    block = engine.module.blocks[0]
    x = whole_sequence(engine, 0, 0)
    with torch.no_grad():
        parallel = block.attention(*block.heads(my_part(x, rank)), 0)
        whole = LocalAttention()(*block.heads(x))
    difference = (parallel.float() - my_part(whole, rank).float()).abs().max().item()
    return {"max_difference": difference, "local_attention_saw": list(block.attention.local_attn.seen)}


def _train(run: UlyssesRun) -> Dict[str, Any]:
    import deepspeed.comm as dist
    from deepspeed.utils import groups

    from deepspeed_offload_patch.hostsync import READ, count_host_syncs
    from deepspeed_offload_patch.testing.equivalence import _flag, _record, _typed, poison_grad
    from deepspeed_offload_patch.testing.models import optimizer_step

    started = time.perf_counter()
    engine = build(run)
    rank = groups._get_sequence_parallel_rank()
    trace: Dict[str, Any] = {"attention": attention_check(engine), "steps": []}
    accum = engine.gradient_accumulation_steps()
    for step in range(run.steps):
        flag = syncs = None
        losses: List[Any] = []
        for micro in range(accum):
            boundary = micro == accum - 1
            handles = []
            if run.fault is not None and run.fault[:3] == (step, micro, dist.get_rank()):
                handles.append(poison_grad(list(engine.module.parameters())[run.fault[4]], float(run.fault[3])))
            loss = engine(my_part(whole_sequence(engine, step, micro), rank))
            losses.append(_typed(loss.detach().float()))
            if boundary:
                with count_host_syncs(device="cpu", kinds=(READ, )) as counter:
                    engine.backward(loss)
                syncs = counter.total
            else:
                engine.backward(loss)
            for handle in handles:
                handle.remove()
            if boundary:
                flag = _flag(engine.optimizer)
            optimizer_step(engine)
        record = _record(engine, step)
        record.update(flag=flag, losses=losses)
        # Not compared between sides (they differ by design): what the patch removes.
        record["boundary_syncs"] = syncs
        trace["steps"].append(record)
    trace["groups"] = {
        "sequence_parallel": list(dist.get_all_ranks_from_group(groups._get_sequence_parallel_group())),
        "zero": list(dist.get_all_ranks_from_group(engine.optimizer.dp_process_group)),
        # DeepSpeed takes the Ulysses mpu for no model parallelism: has_overflow() all-reduces over ZeRO's group only.
        "model_parallel_group": getattr(engine.optimizer, "model_parallel_group", None) is not None,
    }
    trace["optimizer"] = type(engine.optimizer).__name__
    trace["seconds"] = time.perf_counter() - started  # engine built and trained, this rank
    destroy = getattr(engine, "destroy", None)
    if callable(destroy):
        destroy()
    return trace


def trace_ulysses(runs: Tuple[UlyssesRun, ...]) -> Dict[str, Any]:
    """Train ``runs`` on this rank (``deepspeed.comm`` initialized on :data:`WORLD` ranks) and return the patch's
    state and each run's trace (see the module doc), in the shape
    :func:`~deepspeed_offload_patch.testing.equivalence.differences` compares.

    Raises whatever DeepSpeed raises: a backend without ``all_to_all_single`` for the dtype fails in the first
    forward, in :func:`attention_check`."""
    import warnings

    import deepspeed_offload_patch

    warnings.simplefilter("ignore", FutureWarning)
    return {"state": deepspeed_offload_patch.status().state, "runs": {run.name: _train(run) for run in runs}}
