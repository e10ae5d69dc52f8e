# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""A differential oracle: a job trained through DeepSpeed with ``offload_optimizer`` against the same job computed in
plain PyTorch.

A :class:`Cell` is one configuration: ZeRO stage (3 also with ``offload_param``), ``gradient_accumulation_steps``,
backwards per step through ``engine.set_gradient_accumulation_boundary`` (Accelerate's route), gradient clipping,
precision. :func:`train_cells` trains cells on this rank through DeepSpeed (``deepspeed.comm`` initialized);
:func:`reference` computes a cell's job in plain PyTorch for ``world_size`` ranks: the mean over ranks of each rank's
summed micro-batch gradients (each loss divided by ``gradient_accumulation_steps``, as DeepSpeed's engine divides it),
the global norm of that gradient, clipping by it, and ``torch.optim.AdamW`` with DeepSpeed's settings. DeepSpeed
without offload is no safe reference: some releases are wrong there too.

:func:`compare` names what differs: every parameter after the steps and the global gradient norm of every step. fp32
must agree to :data:`FP32_TOLERANCE`; bf16 (DeepSpeed's model and gradients in bf16, the reference's forward and
backward on a bf16 copy of fp32 master weights, its sums and its optimizer in fp32) to
:data:`BF16_TOLERANCE`, where DeepSpeed is right, measured on 0.19.8, and well under what a dropped micro-batch
changes.

:func:`run` trains every cell unpatched and patched, each twice (a cell whose runs disagree is ``unstable``); ZeRO-3
cells, before DeepSpeed 0.19.8, with every parameter all-gather waited for (:mod:`.zero3_gather`: a race of the CPU
accelerator that 0.19.8 fixed; ``--as-shipped`` leaves it). ``nox -s oracle`` runs it on one release per form and
``ci/oracle_table.py`` renders docs/releases.md's table from what it wrote.

    python -m deepspeed_offload_patch.testing.oracle --json oracle.json   # exit 1 when a patched cell is wrong
"""

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

LAYERS, HIDDEN, MICRO_BATCH = 8, 16, 2
LR, WEIGHT_DECAY, CLIP, SEED = 1e-2, 0.01, 0.05, 4321
#: (absolute, relative) tolerances: fp32 to 1e-6; bf16 as measured where DeepSpeed is right (see the module's doc).
FP32_TOLERANCE = (1e-6, 1e-6)
BF16_TOLERANCE = (4e-3, 2e-2)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One job: ZeRO ``stage`` with ``offload_optimizer`` (and ``offload_param`` at stage 3 when asked),
    ``grad_accum`` micro-steps per optimizer step, or with ``grad_accum`` 1, ``backwards`` backward calls per step
    (each but the last outside the accumulation boundary), gradient clipping on or off, ``precision`` fp32 or bf16."""

    stage: int
    grad_accum: int = 1
    backwards: int = 1
    clipping: bool = False
    precision: str = "fp32"
    offload_param: bool = False
    steps: int = 4

    def __post_init__(self) -> None:
        if self.backwards > 1 and self.grad_accum > 1:
            raise ValueError("several backwards per step are for gradient_accumulation_steps 1")
        if self.offload_param and self.stage != 3:
            raise ValueError("offload_param is ZeRO-3's")

    @property
    def name(self) -> str:
        stage = f"s{self.stage}" + ("-param" if self.offload_param else "")
        way = f"bw{self.backwards}" if self.backwards > 1 else f"ga{self.grad_accum}"
        return f"{stage}-{way}-{'clip' if self.clipping else 'noclip'}-{self.precision}"

    @property
    def micro_batches(self) -> int:
        return max(self.grad_accum, self.backwards)

    def config(self) -> Dict[str, Any]:
        zero: Dict[str, Any] = {"stage": self.stage, "offload_optimizer": {"device": "cpu"}}
        if self.offload_param:
            zero["offload_param"] = {"device": "cpu"}
        config: Dict[str, Any] = {
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_accumulation_steps": self.grad_accum,
            "optimizer": {
                "type": "AdamW",
                "params": {
                    "lr": LR,
                    "weight_decay": WEIGHT_DECAY,
                    "torch_adam": True
                }
            },
            "zero_optimization": zero,
            "zero_force_ds_cpu_optimizer": False,
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        if self.clipping:
            config["gradient_clipping"] = CLIP
        if self.precision == "bf16":
            config["bf16"] = {"enabled": True}
        elif self.precision != "fp32":
            raise ValueError(f"precision must be fp32 or bf16, not {self.precision!r}")
        return config


def every_cell() -> List[Cell]:
    """The whole oracle: every stage (ZeRO-3 with and without ``offload_param``) x accumulation 1 - 4 and several
    backwards x clipping x fp32/bf16."""
    ways = [dict(grad_accum=n) for n in (1, 2, 3, 4)] + [dict(backwards=4)]
    stages = [dict(stage=1), dict(stage=2), dict(stage=3), dict(stage=3, offload_param=True)]
    return [
        Cell(precision=precision, clipping=clipping, **stage, **way) for stage in stages for way in ways
        for clipping in (False, True) for precision in ("fp32", "bf16")
    ]


def model() -> torch.nn.Module:
    """The oracle's model, seeded: the same initial weights in every process."""
    from deepspeed_offload_patch.testing.models import ManyLinear

    torch.manual_seed(SEED)
    return ManyLinear(2 * LAYERS, HIDDEN)


def inputs(step: int, micro: int, rank: int) -> torch.Tensor:
    """The micro-batch of ``rank`` at micro-step ``micro`` of optimizer step ``step``, in fp32 on the CPU."""
    generator = torch.Generator().manual_seed(100_000 * step + 100 * micro + rank)
    return torch.randn(MICRO_BATCH, HIDDEN, generator=generator)


def full_parameters(engine, stage: int) -> Dict[str, torch.Tensor]:
    """``engine``'s parameters, whole (gathered at ZeRO-3), in fp32 on the CPU, by name."""
    params = dict(engine.module.named_parameters())
    if stage == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {name: p.detach().float().cpu().clone() for name, p in params.items()}
    return {name: p.detach().float().cpu().clone() for name, p in params.items()}


def _norm(value: Any) -> Optional[float]:
    if value is None:
        return None
    return float(value.item() if torch.is_tensor(value) else value)


def train(cell: Cell) -> Dict[str, Any]:
    """Train ``cell`` on this rank through DeepSpeed; its global gradient norm after each step and its parameters
    after the last (gathered at ZeRO-3), in fp32 on the CPU. Raises what DeepSpeed raises."""
    import deepspeed
    from deepspeed import comm as dist

    engine, _, _, _ = deepspeed.initialize(model=model(), config=cell.config())
    rank = dist.get_rank()
    dtype = torch.bfloat16 if cell.precision == "bf16" else torch.float32
    norms = []
    for step in range(cell.steps):
        for micro in range(cell.micro_batches):
            last = micro == cell.micro_batches - 1
            if cell.backwards > 1:
                engine.set_gradient_accumulation_boundary(last)
            engine.backward(engine(inputs(step, micro, rank).to(engine.device, dtype)))
            if cell.grad_accum > 1 or last:
                with torch.no_grad():  # as testing.models.optimizer_step: 0.18.7 - 0.18.9 fail in grad mode
                    engine.step()
        norms.append(_norm(engine.get_global_grad_norm()))
    return {"norms": norms, "params": full_parameters(engine, cell.stage)}


def train_cells(cells: Sequence[Cell],
                setup: Optional[Callable[[], None]] = None,
                gather_wait: bool = True) -> Dict[str, Any]:
    """:func:`train` each cell on this rank, after ``setup()`` (which must pickle: a module-level function); a cell
    whose job raised gets ``{"error": ...}``; with the package's status of each change under ``"status"``. With
    ``gather_wait`` (the default) and a ZeRO-3 cell among ``cells``, ZeRO-3's parameter all-gathers are waited for
    one by one where the release does not (:mod:`.zero3_gather`: before 0.19.8, a race of the CPU accelerator);
    ``"zero3_gather_wait"`` says whether that was in place."""
    import warnings

    import deepspeed_offload_patch
    from deepspeed_offload_patch.testing import zero3_gather

    warnings.simplefilter("ignore", FutureWarning)
    if setup is not None:
        setup()
    found: Dict[str, Any] = {}
    found["zero3_gather_wait"] = bool(gather_wait and any(cell.stage == 3 for cell in cells)
                                      and zero3_gather.wait_every_gather())
    for cell in cells:
        try:
            found[cell.name] = train(cell)
        except Exception as exc:  # a release that cannot run the cell: the table says so
            found[cell.name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    from deepspeed_offload_patch.changes import CHANGES

    found["zero3_gathers_waited"] = zero3_gather.waited
    status = deepspeed_offload_patch.status()
    found["status"] = {change.name: str(status.of(change)[0]) for change in CHANGES}
    return found


def reference(cell: Cell, world_size: int) -> Dict[str, Any]:
    """``cell``'s job in plain PyTorch for ``world_size`` data-parallel ranks: the norms and the parameters
    :func:`train` returns. fp32 master weights; in bf16 the forward and backward run on a bf16 copy of them, as
    DeepSpeed's bf16 does, and the parameters returned are that copy."""
    master = model()
    optimizer = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    params = list(master.parameters())
    low = cell.precision == "bf16"
    net = model().to(torch.bfloat16) if low else master
    working = list(net.parameters())
    norms, clipped = [], 0
    for step in range(cell.steps):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(world_size):
            for micro in range(cell.micro_batches):
                loss = net(inputs(step, micro, rank).to(torch.bfloat16 if low else torch.float32))
                if cell.grad_accum > 1:
                    loss = loss / cell.grad_accum
                for acc, grad in zip(total, torch.autograd.grad(loss, working)):
                    acc.add_(grad.float())
        grads = [g / world_size for g in total]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        if cell.clipping and norm > CLIP:
            clipped += 1
            grads = [g * (CLIP / (norm + 1e-6)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
        if low:
            with torch.no_grad():
                for w, p in zip(working, params):
                    w.copy_(p)
        norms.append(norm)
    if cell.clipping and not clipped:
        raise AssertionError(f"{cell.name}: the reference never clipped; CLIP={CLIP} is too high to test clipping")
    return {"norms": norms, "params": {name: p.detach().float().clone() for name, p in net.named_parameters()}}


def compare(cell: Cell,
            trained: Dict[str, Any],
            expected: Dict[str, Any],
            tolerance: Optional[Tuple[float, float]] = None) -> List[str]:
    """What of one rank's ``trained`` result differs from the ``expected`` reference beyond ``tolerance`` ((absolute,
    relative); by default the cell's precision's): empty when it learned the same job."""
    if "error" in trained:
        return [f"{cell.name}: raised {trained['error']}"]
    atol, rtol = tolerance or (BF16_TOLERANCE if cell.precision == "bf16" else FP32_TOLERANCE)
    problems = []
    for step, (got, want) in enumerate(zip(trained["norms"], expected["norms"])):
        if got is None or not math.isclose(got, want, rel_tol=rtol, abs_tol=atol):
            problems.append(f"{cell.name}: step {step} gradient norm {got} != {want:.6g}")
    worst = max(
        (float((trained["params"][name] - want).abs().max()), name) for name, want in expected["params"].items())
    limit = atol + rtol * max(float(p.abs().max()) for p in expected["params"].values())
    if worst[0] > limit:
        problems.append(f"{cell.name}: parameters off by up to {worst[0]:.3g} ({worst[1]}), tolerance {limit:.3g}")
    return problems


def outcome(cell: Cell, runs: Sequence[Dict[str, Any]], expected: Dict[str, Any]) -> str:
    """``right``, ``wrong``, ``error`` (the job raised) or ``unstable`` (runs of the same job disagree), for the
    table: each of ``runs`` is one run's rank-0 result."""
    found = {
        "error" if "error" in run[cell.name] else "wrong" if compare(cell, run[cell.name], expected) else "right"
        for run in runs
    }
    return found.pop() if len(found) == 1 else "unstable"


def run(cells: Sequence[Cell], world_size: int = 2, repeats: int = 2, gather_wait: bool = True) -> Dict[str, Any]:
    """Every cell, unpatched and patched (fresh ranks each, ``repeats`` times), against the reference; the JSON-ready
    outcome table. ``gather_wait``: as :func:`train_cells` (False trains ZeRO-3 as the release ships it, race and
    all)."""
    import deepspeed

    from deepspeed_offload_patch.settings import DISABLE
    from deepspeed_offload_patch.testing.launch import run_distributed

    sides = {
        side: [
            run_distributed(train_cells, world_size, args=(tuple(cells), None, gather_wait), env={DISABLE: flag})[0]
            for _ in range(repeats)
        ]
        for side, flag in (("unpatched", "1"), ("patched", "0"))
    }
    rows = []
    for cell in cells:
        expected = reference(cell, world_size)
        row = dict(dataclasses.asdict(cell), name=cell.name)
        for side, runs in sides.items():
            row[side] = outcome(cell, runs, expected)
            row[f"{side}_problems"] = [p for run in runs for p in compare(cell, run[cell.name], expected)][:3]
        rows.append(row)
    return {
        "deepspeed": deepspeed.__version__.strip(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "world_size": world_size,
        "repeats": repeats,
        "zero3_gather_wait": any(runs[0]["zero3_gather_wait"] for runs in sides.values()),
        "status": sides["patched"][0]["status"],
        "cells": rows
    }


def merge(old: Dict[str, Any], new: Dict[str, Any]) -> Dict[str, Any]:
    """``new``'s table with ``old``'s rows of the stages ``new`` did not train (the same release, world size and
    repeats, else ValueError): a run of some stages updates a recorded table."""
    for key in ("deepspeed", "world_size", "repeats"):
        # An sdist's version.txt can leave a trailing newline's space in __version__: the same release.
        recorded, now = (str(old.get(key, 1)).strip(), str(new[key]).strip())
        if recorded != now:
            raise ValueError(f"the recorded table has {key} {recorded!r}, this run {now!r}")
    trained = {row["stage"] for row in new["cells"]}
    kept = [row for row in old["cells"] if row["stage"] not in trained]
    order = {cell.name: n for n, cell in enumerate(every_cell())}
    merged = dict(new, cells=sorted(kept + new["cells"], key=lambda row: order.get(row["name"], len(order))))
    if 3 not in trained:
        merged["zero3_gather_wait"] = old.get("zero3_gather_wait", False)
    return merged


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the outcome table")
    parser.add_argument("--repeats",
                        type=int,
                        default=2,
                        help="runs of each side (default 2): cells whose runs "
                        "disagree are unstable")
    parser.add_argument("--stage",
                        type=int,
                        action="append",
                        choices=(1, 2, 3),
                        help="train only this ZeRO stage's cells (repeatable) and keep the other stages' rows of the "
                        "table already in --json (same release and repeats)")
    parser.add_argument("--as-shipped",
                        action="store_true",
                        help="train ZeRO-3 without waiting for each parameter all-gather where the release waits for "
                        "the last alone (before 0.19.8; testing/zero3_gather.py): its CPU race shows")
    args = parser.parse_args(argv)
    cells = [cell for cell in every_cell() if not args.stage or cell.stage in args.stage]
    table = run(cells, repeats=args.repeats, gather_wait=not args.as_shipped)
    if args.stage and os.path.exists(args.json):
        with open(args.json) as f:
            table = merge(json.load(f), table)
    with open(args.json, "w") as f:
        json.dump(table, f, indent=1)
    # Trained as shipped, ZeRO-3 before 0.19.8 can lose the CPU gather race: its cells are reported, not held.
    held = [row for row in table["cells"] if not (args.as_shipped and row["stage"] == 3)]
    wrong = [row["name"] for row in held if row["patched"] != "right"]
    right = {side: sum(row[side] == "right" for row in table["cells"]) for side in ("unpatched", "patched")}
    print(f"DeepSpeed {table['deepspeed']}: {len(table['cells'])} cells; right unpatched {right['unpatched']}, "
          f"patched {right['patched']}; wrote {os.path.abspath(args.json)}")
    for name in wrong:
        print(f"  patched, not right: {name}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
