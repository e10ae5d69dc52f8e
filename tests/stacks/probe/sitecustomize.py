# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Measures each rank of a training run that knows nothing of it: Python imports this file at start-up in every
process whose PYTHONPATH holds this folder (``tests/stacks/test_stacks.py`` puts it there).

It is active only where ``DS_STACK_PROBE_DIR`` is set. Once ``deepspeed.runtime.engine`` is imported, it wraps
``DeepSpeedEngine.backward`` and ``step`` on the class (so engines that HF Trainer, Accelerate or Lightning build are
covered):

* each boundary backward (``is_gradient_accumulation_boundary()``) runs under ``count_host_syncs()``, and its
  count is kept;
* after each optimizer step (``step()`` advanced ``global_steps``) the losses its backwards saw and a sha256 of
  every parameter's bytes are kept.

Each rank writes ``rank-<RANK>.json`` into that folder after every optimizer step and at exit: the patch state,
where the fix's methods of ``DeepSpeedZeroOptimizer`` come from, the sync counts, the losses and the digests.

It never imports ``deepspeed_offload_patch``: importing the package applies the patch, which would spoil both the
unpatched reference and the check that a plain import applies it. The host-sync counter is loaded from the
package's ``hostsync.py`` by file path (that module imports nothing of the package). Then it runs the
``sitecustomize`` further on ``sys.path``, if any, so one in front of it (``ds-offload-patch run``'s) and one behind
it both keep working.
"""

import atexit
import functools
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import threading

DIR = "DS_STACK_PROBE_DIR"
ENGINE_MODULE = "deepspeed.runtime.engine"
ZERO_MODULE = "deepspeed.runtime.zero.stage_1_and_2"
#: The fix's tracker is one of these, by release (0.17.1 on: the first; 0.14.0 - 0.17.0: the second); the fix also
#: replaces ``has_overflow``. The upstream change's record (``changes.UPSTREAM.forms``) says the same, but importing it applies the patch.
TRACKERS = ("update_offload_overflow_tracker", "update_overflow_tracker_for_param_grad")

_HERE = os.path.dirname(os.path.abspath(__file__))
_local = threading.local()
_record = {"boundary_backward_syncs": [], "steps": []}
_pending_losses = []
_engine_seen = []


def _hostsync():
    """The package's ``hostsync`` module, loaded from its file under a name of its own (no package import)."""
    name = "_ds_stack_probe_hostsync"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec("deepspeed_offload_patch")  # finds the package without running its __init__
    path = os.path.join(list(spec.submodule_search_locations)[0], "hostsync.py")
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module


def _digest(engine) -> str:
    """sha256 over every parameter's name and bytes, in ``named_parameters()`` order."""
    import torch

    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in engine.module.named_parameters():
            digest.update(name.encode())
            digest.update(param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _method_origins() -> dict:
    zero = sys.modules.get(ZERO_MODULE)
    if zero is None:
        return {}
    cls = zero.DeepSpeedZeroOptimizer
    tracker = next((name for name in TRACKERS if name in cls.__dict__), TRACKERS[0])
    return {name: getattr(cls.__dict__.get(name), "__module__", "missing") for name in (tracker, "has_overflow")}


def _engine_facts(engine) -> dict:
    """What the stack made of its DeepSpeed config: the test checks that it is the setup under test."""
    return {
        "world_size": engine.world_size,
        "parameter_tensors": sum(1 for _ in engine.module.parameters()),
        "zero_stage": engine.zero_optimization_stage(),
        "offload_optimizer": bool(engine.zero_cpu_offload()),
        "bf16": bool(engine.bfloat16_enabled()),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "optimizer": type(getattr(engine, "optimizer", None)).__name__,
        "basic_optimizer": type(getattr(engine, "basic_optimizer", None)).__name__,
    }


def _patch_state() -> str:
    package = sys.modules.get("deepspeed_offload_patch")
    return package.status().state if package is not None else "not imported"


def _write() -> None:
    if not _engine_seen:
        return  # a launcher process: it trained nothing
    engine = _engine_seen[0]
    rank = getattr(engine, "global_rank", None)
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    report = dict(_record,
                  rank=rank,
                  patch_state=_patch_state(),
                  methods=_method_origins(),
                  engine=_engine_facts(engine),
                  pid=os.getpid())
    path = os.path.join(os.environ[DIR], f"rank-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


def _wrap_backward(method):

    @functools.wraps(method)
    def backward(self, loss, *args, **kwargs):
        if getattr(_local, "active", False):  # a nested engine call counts once, in the outer one
            return method(self, loss, *args, **kwargs)
        if not _engine_seen:
            _engine_seen.append(self)
        boundary = self.is_gradient_accumulation_boundary()  # before the call: backward() moves the micro-step
        _local.active = True
        try:
            if boundary:
                with _hostsync().count_host_syncs(kinds=("read", )) as syncs:
                    result = method(self, loss, *args, **kwargs)
                _record["boundary_backward_syncs"].append(syncs.total)
            else:
                result = method(self, loss, *args, **kwargs)
        finally:
            _local.active = False
        _pending_losses.append(loss.detach().float().item())  # read outside the counted block
        return result

    return backward


def _wrap_step(method):

    @functools.wraps(method)
    def step(self, *args, **kwargs):
        before = getattr(self, "global_steps", None)
        result = method(self, *args, **kwargs)
        if getattr(_local, "active", False) or getattr(self, "global_steps", None) == before:
            return result  # not an optimizer step (a micro-step's step(), or nested)
        _record["steps"].append({
            "global_steps": self.global_steps,
            "losses": list(_pending_losses),
            "params_sha256": _digest(self)
        })
        _pending_losses.clear()
        _write()  # after every step too: a rank ended with os._exit still leaves its numbers
        return result

    return step


def _instrument(module) -> None:
    cls = module.DeepSpeedEngine
    if getattr(cls, "__ds_stack_probe__", False):
        return
    cls.backward = _wrap_backward(cls.backward)
    cls.step = _wrap_step(cls.step)
    cls.__ds_stack_probe__ = True


class _EngineImportHook(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed.runtime.engine`` with the other finders and instruments it once it has run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ENGINE_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_instrument(module, exec_module=exec_module):
                    exec_module(module)
                    _instrument(module)

                spec.loader.exec_module = exec_and_instrument
                return spec
        return None


def _install() -> None:
    if not os.environ.get(DIR):
        return
    os.makedirs(os.environ[DIR], exist_ok=True)
    if ENGINE_MODULE in sys.modules:
        _instrument(sys.modules[ENGINE_MODULE])
    else:
        sys.meta_path.insert(0, _EngineImportHook())
    atexit.register(_write)


def _run_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` found on ``sys.path`` after this folder (not before it: one in front of this one
    has run already, and is what ran this one)."""
    entries = [os.path.abspath(p or os.curdir) for p in sys.path]
    if _HERE in entries:
        rest = sys.path[entries.index(_HERE) + 1:]
    else:
        rest = [path for path, absolute in zip(sys.path, entries) if absolute != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


try:
    _install()
except Exception as exc:  # a probe that fails to install must show, not stop the run: the test then finds no report
    print(f"[ds-stack-probe] not installed: {exc!r}", file=sys.stderr)
_run_next_sitecustomize()
