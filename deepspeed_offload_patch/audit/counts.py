# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""One audited process's counts (:class:`PhaseCounts`): host syncs (reads of device values) per phase and optimizer
step, with the source lines behind them, every kind of host wait per step, and the report each rank writes of them
(:mod:`deepspeed_offload_patch.audit.rank` counts)."""

import os
import socket
import sys
import threading
from collections import Counter
from typing import Any, Dict, List, Optional

from deepspeed_offload_patch.audit.report import PHASES, PIPELINE_PHASES
from deepspeed_offload_patch.waits import KINDS, READ, kind_of

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
    """One process's counts: a dict of phase counts per optimizer step, and the source lines behind them. The
    phases are the engine's (:data:`PHASES`) until :meth:`claim` gives them to the pipeline engine."""

    def __init__(self, steps: int, top: int):
        self.steps_wanted = steps
        self.top = top
        self.engine: Optional[str] = None
        self.phases = PHASES
        self.steps: List[Dict[str, int]] = []
        self.cuda_steps: List[Optional[Dict[str, int]]] = []
        self.lines: Dict[str, Counter] = {phase: Counter() for phase in self.phases}
        self.current = self._empty()
        self.current_cuda: Optional[Dict[str, int]] = None
        # The whole step's host waits by kind (reads, event waits, ...), one dict per step.
        self.kind_steps: List[Dict[str, int]] = []
        self.current_kinds = dict.fromkeys(KINDS, 0)
        self.cuda_available = True
        self.calls = 0
        self.done = False
        self.local = threading.local()

    def _empty(self) -> Dict[str, int]:
        return {phase: 0 for phase in self.phases}

    def claim(self, engine: str) -> bool:
        """Whether calls of this kind of engine (``"engine"`` or ``"pipeline"``) count here: the first kind to ask
        fixes the phases (the pipeline's are :data:`PIPELINE_PHASES`); the other kind then does not count."""
        if self.engine is None:
            self.engine = engine
            if engine == "pipeline":
                self.phases = PIPELINE_PHASES
                self.lines = {phase: Counter() for phase in self.phases}
                self.current = self._empty()
        return self.engine == engine

    def add(self, phase: str, events, cuda: Optional[Dict[str, int]]) -> None:
        self.calls += 1
        for op, where in events:
            kind = kind_of(op)
            self.current_kinds[kind] += 1
            if kind == READ:  # the phases and their lines count the host syncs (reads); the kinds, every wait
                self.current[phase] += 1
                self.lines[phase][(_short(where), op)] += 1
        if cuda is None:
            self.cuda_available = False
        elif self.cuda_available:
            self.current_cuda = self.current_cuda or self._empty()
            self.current_cuda[phase] += sum(cuda.values())

    def end_step(self) -> None:
        self.steps.append(self.current)
        self.cuda_steps.append(self.current_cuda)
        self.kind_steps.append(self.current_kinds)
        self.current_kinds = dict.fromkeys(KINDS, 0)
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
            "engine": self.engine or "engine",
            "phases": list(self.phases),
            "steps": self.steps,
            "cuda_syncs": self.cuda_steps if cuda else None,
            "kinds": self.kind_steps,
            "top": {
                phase: [{
                    "line": line,
                    "op": op,
                    "count": count
                } for (line, op), count in self.lines[phase].most_common(self.top)]
                for phase in self.phases
            },
        }
