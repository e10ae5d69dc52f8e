# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""One inf or NaN in one gradient: what an offload job does with it, as one outcome per configuration.

A :class:`Cell` is one job: 2 ranks, ZeRO stage 1, 2 or 3 with ``offload_optimizer`` (3 also with
``offload_param``), a precision (bf16 with ``check_grad_overflow`` true, false or left out of the config; fp16; fp32),
``gradient_accumulation_steps`` 1 or 2, and a fault: an inf or a NaN put into one element of the first layer's
weight gradient, in the boundary micro-batch of step :data:`FAULT_STEP`, on rank 0 or on every rank. Each rank keeps
the full parameters after every step (gathered at ZeRO-3) and the engine's count of skipped steps.

:func:`classify` names what happened, as one of :data:`OUTCOMES`:

* ``skipped``: only the faulty step skipped (parameters unchanged by it, every later step trains, all finite);
* ``nan-weights``: a parameter is inf or NaN after some step (the fault reached the weights);
* ``applied``: the faulty step changed the parameters but they stayed finite (an update from a bad gradient);
* ``crash``: every rank raised the same error;
* ``ranks-disagree``: the ranks raised different errors, one raised and another did not, they hung, or their
  parameters differ;
* ``freeze``: a later step changed nothing (skipped again, or trained to no effect).

:func:`run` trains cells unpatched and patched, each cell in fresh ranks (a crash or a hang cannot reach the next);
``nox -s outcomes`` runs it on one release per form and writes ``docs/outcomes/<release>.json``, from which
``ci/outcomes_table.py`` renders docs/releases.md's table.

    python -m deepspeed_offload_patch.testing.outcomes --json outcomes.json             # the core cells
    python -m deepspeed_offload_patch.testing.outcomes --json outcomes.json --every     # every cell
    python -m deepspeed_offload_patch.testing.outcomes --json outcomes.json --stage 3   # ZeRO-3's rows again
"""

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from deepspeed_offload_patch.testing import oracle

STEPS, FAULT_STEP = 4, 1
PRECISIONS = ("bf16", "bf16-off", "bf16-unset", "fp16", "fp32")
OUTCOMES = ("skipped", "nan-weights", "applied", "crash", "ranks-disagree", "freeze")
#: A cell's ranks that have not finished in this many seconds hang (ranks waiting in different collectives): far
#: above a correct cell's few seconds on a busy machine, so only a hang reaches it.
HANG_S = 600.0


@dataclasses.dataclass(frozen=True)
class Cell:
    """One job with one fault (see the module's doc)."""

    stage: int
    precision: str = "bf16"
    grad_accum: int = 1
    fault: str = "inf"
    every_rank: bool = False
    offload_param: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {self.precision!r}")
        if self.fault not in ("inf", "nan"):
            raise ValueError(f"fault must be 'inf' or 'nan', not {self.fault!r}")
        if self.offload_param and self.stage != 3:
            raise ValueError("offload_param is ZeRO-3's")

    @property
    def name(self) -> str:
        stage = f"s{self.stage}" + ("-param" if self.offload_param else "")
        where = "every" if self.every_rank else "one"
        return f"{stage}-{self.precision}-ga{self.grad_accum}-{self.fault}-{where}"

    def config(self) -> Dict[str, Any]:
        """The DeepSpeed config: the oracle's job (torch AdamW, no clipping), this precision and accumulation."""
        config = oracle.Cell(stage=self.stage, grad_accum=self.grad_accum, offload_param=self.offload_param).config()
        if self.precision.startswith("bf16"):
            config["bf16"] = {"enabled": True}
            if self.precision != "bf16-unset":
                config["bf16"]["check_grad_overflow"] = self.precision == "bf16"
        elif self.precision == "fp16":
            # A small initial scale: no overflow but the one put in (2**16 would overflow the first steps).
            config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
        return config


def core_cells() -> List[Cell]:
    """An inf on one rank, every stage (ZeRO-3 with and without ``offload_param``) x every precision x accumulation 1
    and 2: the cells the recorded tables hold."""
    stages = [dict(stage=1), dict(stage=2), dict(stage=3), dict(stage=3, offload_param=True)]
    return [
        Cell(precision=precision, grad_accum=grad_accum, **stage) for stage in stages for precision in PRECISIONS
        for grad_accum in (1, 2)
    ]


def every_cell() -> List[Cell]:
    """:func:`core_cells` with an inf and a NaN, on one rank and on every rank."""
    return [
        dataclasses.replace(cell, fault=fault, every_rank=every) for cell in core_cells() for fault in ("inf", "nan")
        for every in (False, True)
    ]


def _fault_hook(cell: Cell, armed: List[bool]):
    value = math.inf if cell.fault == "inf" else math.nan

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not armed[0]:
            return grad
        armed[0] = False
        grad = grad.clone()
        grad.view(-1)[0] = value
        return grad

    return hook


def train(cell: Cell) -> Dict[str, Any]:
    """Train ``cell`` on this rank (``deepspeed.comm`` initialized): ``{"params": [{name: fp32 tensor}, ...]}`` before
    the first step and after each, ``"skipped"``: the engine's count of skipped steps after each; or ``{"error": ...,
    "at": step}`` where DeepSpeed raised (the step it was in, -1 in ``initialize``)."""
    import deepspeed
    from deepspeed import comm as dist

    from deepspeed_offload_patch.testing import allow_fp16_on_cpu, zero3_gather

    if cell.precision == "fp16":
        allow_fp16_on_cpu()
    if cell.stage == 3:
        # Before 0.19.8 ZeRO-3 on the CPU can read a half-gathered parameter (:mod:`.zero3_gather`): ranks would
        # seem to disagree for a reason that is not the fault.
        zero3_gather.wait_every_gather()
    rank = dist.get_rank()
    step = -1
    try:
        engine, _, _, _ = deepspeed.initialize(model=oracle.model(), config=cell.config())
        dtype = {"fp16": torch.float16, "fp32": torch.float32}.get(cell.precision, torch.bfloat16)
        armed = [False]
        first = next(iter(engine.module.parameters()))
        first.register_hook(_fault_hook(cell, armed))
        found: Dict[str, Any] = {"params": [oracle.full_parameters(engine, cell.stage)], "skipped": []}
        for step in range(STEPS):
            for micro in range(cell.grad_accum):
                armed[0] = (step == FAULT_STEP and micro == cell.grad_accum - 1 and (cell.every_rank or rank == 0))
                engine.backward(engine(oracle.inputs(step, micro, rank).to(engine.device, dtype)))
                with torch.no_grad():  # as the oracle: 0.18.7 - 0.18.9 fail in grad mode
                    engine.step()
            found["params"].append(oracle.full_parameters(engine, cell.stage))
            found["skipped"].append(int(engine.skipped_steps))
        return found
    except Exception as exc:  # the outcome is the error; the peer learns of it through its own collectives
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}", "at": step}


def train_one(cell: Cell) -> Dict[str, Any]:
    """:func:`train`, with the package's status of each change (under ``"status"``): what a rank of :func:`run`
    calls."""
    import warnings

    import deepspeed_offload_patch
    from deepspeed_offload_patch.changes import CHANGES

    warnings.simplefilter("ignore", FutureWarning)
    found = train(cell)
    status = deepspeed_offload_patch.status()
    found["status"] = {change.name: str(status.of(change)[0]) for change in CHANGES}
    return found


def train_row(cells: Sequence[Cell]) -> Dict[str, Any]:
    """:func:`train` each of ``cells`` on this rank, one after the other in the same ranks, by name: what the upstream
    watch's one launch calls (a cell that hangs takes the rest with it, which is a failure of the row either way)."""
    import warnings

    warnings.simplefilter("ignore", FutureWarning)
    return {cell.name: train(cell) for cell in cells}


def _same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    """The same bits in every parameter, a NaN equal to a NaN (ranks that both hold NaN weights agree)."""
    return all(torch.allclose(a[name], b[name], rtol=0, atol=0, equal_nan=True) for name in a)


def _finite(params: Dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in params.values())


def classify(ranks: Sequence[Dict[str, Any]]) -> Tuple[str, str]:
    """``(outcome, detail)`` of one cell from each rank's :func:`train` result (None for a rank that never
    reported: a hang)."""
    if any(rank is None for rank in ranks):
        return "ranks-disagree", "a rank did not finish (the ranks wait in different collectives)"
    errors = [rank.get("error") for rank in ranks]
    if any(errors):
        if all(errors) and len(set(errors)) == 1:
            return "crash", f"{errors[0]} (step {ranks[0]['at']})"
        said = "; ".join(f"rank {n}: {error or 'finished'}" for n, error in enumerate(errors))
        return "ranks-disagree", said
    first = ranks[0]
    for step in range(len(first["params"])):
        if not all(_same(first["params"][step], rank["params"][step]) for rank in ranks[1:]):
            return "ranks-disagree", f"the ranks' parameters differ after step {step - 1}"
    for step, params in enumerate(first["params"][1:]):
        if not _finite(params):
            return "nan-weights", f"non-finite parameters after step {step}, skipped steps {first['skipped'][step]}"
    before, at = first["params"][FAULT_STEP], first["params"][FAULT_STEP + 1]
    if not _same(before, at):
        return "applied", f"step {FAULT_STEP} changed the parameters, skipped steps {first['skipped'][FAULT_STEP]}"
    for step in range(FAULT_STEP + 1, STEPS):
        if _same(first["params"][step], first["params"][step + 1]):
            return "freeze", f"step {step} changed nothing, skipped steps {first['skipped'][step]}"
    counted = first["skipped"][-1]
    return "skipped", f"skipped steps {counted}" + ("" if counted == 1 else " (the skip is not counted as 1)")


def run_cell(cell: Cell, env: Dict[str, str], fork_server: bool = False) -> Tuple[str, str, Dict[str, str]]:
    """``(outcome, detail, status)`` of ``cell`` trained in fresh ranks with ``env`` (``fork_server``: as
    :func:`~deepspeed_offload_patch.testing.launch.run_distributed`; the test suite's)."""
    from deepspeed_offload_patch.testing.launch import DistributedFailure, run_distributed

    try:
        ranks = run_distributed(train_one, 2, args=(cell, ), env=env, timeout=HANG_S, fork_server=fork_server)
    except DistributedFailure as failure:
        text = str(failure)
        if "did not finish" in text:
            return "ranks-disagree", "hung: " + text.splitlines()[0][:200], {}
        return "ranks-disagree", "a rank failed outside the job: " + text.strip().splitlines()[-1][:200], {}
    return (*classify(ranks), ranks[0]["status"])


def run(cells: Sequence[Cell]) -> Dict[str, Any]:
    """Every cell unpatched and patched; the JSON-ready outcome table."""
    import deepspeed

    from deepspeed_offload_patch.settings import DISABLE

    rows, status = [], {}
    for cell in cells:
        row = dict(dataclasses.asdict(cell), name=cell.name)
        for side, flag in (("unpatched", "1"), ("patched", "0")):
            outcome, detail, found = run_cell(cell, {DISABLE: flag})
            row[side], row[f"{side}_detail"] = outcome, detail
            if side == "patched" and found:
                status = found
        rows.append(row)
        print(f"{cell.name}: {row['unpatched']} -> {row['patched']}", flush=True)
    return {
        "deepspeed": deepspeed.__version__.strip(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "world_size": 2,
        "steps": STEPS,
        "fault_step": FAULT_STEP,
        "status": status,
        "cells": rows
    }


def _merged(table: Dict[str, Any], path: str) -> Dict[str, Any]:
    """``table``'s rows in place of the same cells' rows of the table recorded at ``path``, the others kept in their
    order. Raises SystemExit when that table is of another release."""
    with open(path) as f:
        recorded = json.load(f)
    if recorded.get("deepspeed", "").strip() != table["deepspeed"]:
        raise SystemExit(f"{path} records DeepSpeed {recorded.get('deepspeed')}, not {table['deepspeed']}: "
                         "record the whole table instead")
    new = {row["name"]: row for row in table["cells"]}
    return dict(table, cells=[new.pop(row["name"], row) for row in recorded["cells"]] + list(new.values()))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the outcome table")
    parser.add_argument("--every", action="store_true", help="inf and NaN, on one rank and on every rank")
    parser.add_argument("--cells", help="only these cells (comma-separated names)")
    parser.add_argument("--stage",
                        type=int,
                        choices=(1, 2, 3),
                        help="only this stage's cells; the other rows of the table already at --json (the same "
                        "release) are kept")
    args = parser.parse_args(argv)
    cells = every_cell() if args.every else core_cells()
    if args.cells:
        cells = [cell for cell in cells if cell.name in args.cells.split(",")]
    if args.stage:
        cells = [cell for cell in cells if cell.stage == args.stage]
    table = run(cells)
    if args.stage and os.path.exists(args.json):
        table = _merged(table, args.json)
    with open(args.json, "w") as f:
        json.dump(table, f, indent=1)
    counts: Dict[str, Dict[str, int]] = {}
    for row in table["cells"]:
        for side in ("unpatched", "patched"):
            counts.setdefault(side, {}).setdefault(row[side], 0)
            counts[side][row[side]] += 1
    print(f"DeepSpeed {table['deepspeed']}: {len(cells)} cells trained, {len(table['cells'])} in the table; {counts}; "
          f"wrote {os.path.abspath(args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
