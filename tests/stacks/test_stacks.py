# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The patch works where users train: real training stacks, started by their own launchers, on 2 CPU ranks.

Each stack's script (HF ``Trainer`` under ``torchrun`` and under the ``deepspeed`` launcher, a plain Accelerate loop
under ``accelerate launch``, Lightning's DeepSpeed strategy starting its own processes) trains a tiny model with
ZeRO-2, the optimizer offloaded to the CPU, bf16 with the overflow check on, gradient accumulation 2, for 4 optimizer
steps. It runs three times, each rank measured by ``probe/sitecustomize.py`` (on PYTHONPATH; the scripts know
nothing of it):

* ``reference``: the package imported but disabled (``DS_OFFLOAD_PATCH_DISABLE=1``): DeepSpeed's own methods, and
  host syncs in every boundary backward on every rank (one per gradient tensor the rank owns);
* ``launcher``: ``ds-offload-patch run -- <launch command>``, the script untouched;
* ``import``: the script's ``--import-patch`` (``import deepspeed_offload_patch`` at its top).

Each patched run (they follow ``DS_OFFLOAD_PATCH_DISABLE``: the red/green run of the ``stacks`` session shows them
failing without the patch) must report on every rank: state ``applied``, both of the fix's methods from
``deepspeed_offload_patch.changes.overflow_flag.methods``, 0 host syncs in every boundary backward, and the losses and parameter digests
of every step bit-identical to the reference's (the runs are deterministic on the CPU). So the patch reaches the
ranks each launcher starts, removes the syncs there, and changes nothing else of the training. And the configs HF
Trainer and Accelerate generate for such a job (``ci/gen_configs.py``) read as affected and fixed in ``ds-offload-patch
affected``.

The measurements (syncs per boundary backward per rank, wall time per launch, what failed) go to
``reports/stacks/stacks-<deepspeed version>.json`` (or ``$DS_STACK_REPORT``).

    python -m pytest -q tests/stacks
"""

import importlib.metadata
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import pytest

from deepspeed_offload_patch import cpu_shm
from deepspeed_offload_patch.testing.launch import free_port
from unit.common import run_command, shm_op_built

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PROBE_DIR = os.path.join(HERE, "probe")
BIN = os.path.dirname(sys.executable)
STEPS = 4
WORLD_SIZE = 2
PATCHED_MODULE = "deepspeed_offload_patch.changes.overflow_flag.methods"
ORIGINAL_MODULE = "deepspeed.runtime.zero.stage_1_and_2"
REFERENCE, LAUNCHER, IMPORT = "reference", "launcher", "import"
PATCHED_MODES = (LAUNCHER, IMPORT)
ENGINE = {
    "world_size": WORLD_SIZE,
    "zero_stage": 2,
    "offload_optimizer": True,
    "bf16": True,
    "gradient_accumulation_steps": 2,
    "optimizer": "DeepSpeedZeroOptimizer",
}

#: name: (the libraries the stack needs, its launch command given a free port)
STACKS: Dict[str, Tuple[Tuple[str, ...], Callable[[int], List[str]]]] = {
    "hf-torchrun": (("transformers", ), lambda port: [
        os.path.join(BIN, "torchrun"), "--nproc_per_node",
        str(WORLD_SIZE), "--master_port",
        str(port), "hf_trainer_train.py"
    ]),
    "hf-deepspeed": (("transformers", ), lambda port: [
        os.path.join(BIN, "deepspeed"), "--num_gpus",
        str(WORLD_SIZE), "--master_port",
        str(port), "hf_trainer_train.py"
    ]),
    "accelerate": (("accelerate", "transformers"), lambda port: [
        os.path.join(BIN, "accelerate"), "launch", "--num_processes",
        str(WORLD_SIZE), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port",
        str(port), "--use_deepspeed", "--deepspeed_config_file", "accelerate_ds_config.json", "accelerate_train.py"
    ]),
    # Lightning starts the second process itself; it reads the port from MASTER_PORT.
    "lightning": (("lightning", ), lambda port: [sys.executable, "lightning_train.py"]),
}
LIBRARIES = ("deepspeed", "torch", "transformers", "accelerate", "lightning")

_runs: Dict[Tuple[str, str], Dict[str, Any]] = {}
_report: Dict[str, Any] = {}


def _versions() -> Dict[str, str]:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _command(stack: str, mode: str, port: int) -> List[str]:
    command = STACKS[stack][1](port)
    if mode == LAUNCHER:
        return [os.path.join(BIN, "ds-offload-patch"), "run", "--"] + command
    return command + ["--import-patch"]


def launch(stack: str, mode: str, tmp_root: str) -> Dict[str, Any]:
    """Run ``stack`` in ``mode`` once (cached) and return what each rank's probe wrote, by rank, with the wall time,
    the exit code and the output's tail."""
    if (stack, mode) in _runs:
        return _runs[(stack, mode)]
    probe_out = os.path.join(tmp_root, f"{stack}-{mode}")
    port = free_port()
    pythonpath = [PROBE_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {
        "DS_STACK_PROBE_DIR": probe_out,
        "PYTHONPATH": os.pathsep.join(pythonpath),
        "PATH": BIN + os.pathsep + os.environ.get("PATH", ""),
        "LOCAL_SIZE": str(WORLD_SIZE),  # DeepSpeed's CPU accelerator counts its devices by it
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "HF_HOME": os.path.join(tmp_root, "hf-home"),  # no user's accelerate config, no cache of theirs
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    # The reference is always unpatched; the patched modes follow this process's switch, so that the red/green run
    # (DS_OFFLOAD_PATCH_DISABLE=1) shows their tests failing.
    env["DS_OFFLOAD_PATCH_DISABLE"] = "1" if mode == REFERENCE else os.environ.get("DS_OFFLOAD_PATCH_DISABLE", "0")
    command = _command(stack, mode, port)
    shm_op_built()  # the unpatched and import routes launch directly: no `run` to build DeepSpeed's shm op first
    started = time.monotonic()
    with cpu_shm.removes_leftovers():  # DeepSpeed's ranks never remove their /dev/shm buffers
        result = run_command(command, env=env, cwd=HERE)
    wall = time.monotonic() - started
    ranks = {}
    for rank in range(WORLD_SIZE):
        path = os.path.join(probe_out, f"rank-{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks[rank] = json.load(f)
    run = {
        "command": " ".join(os.path.basename(a) if a.startswith(BIN) else a for a in command),
        "returncode": result.returncode,
        "wall_s": round(wall, 1),
        "ranks": ranks,
        "output": (result.stdout + result.stderr)[-6000:],
    }
    _runs[(stack, mode)] = run
    _record(stack, mode, run)
    return run


def _by_rank(ranks: Dict[int, Dict[str, Any]], key: str) -> Dict[int, Any]:
    return dict((rank, found.get(key)) for rank, found in ranks.items())


def _record(stack: str, mode: str, run: Dict[str, Any]) -> None:
    ranks = run["ranks"]
    entry = _report.setdefault("stacks", {}).setdefault(stack, {})
    entry[mode] = {
        "command": run["command"],
        "returncode": run["returncode"],
        "wall_s": run["wall_s"],
        "state": _by_rank(ranks, "patch_state"),
        "boundary_backward_syncs": _by_rank(ranks, "boundary_backward_syncs"),
        "parameter_tensors": next((r["engine"].get("parameter_tensors") for r in ranks.values()), None),
    }


def _set_outcome(stack: str, mode: str, problems: List[str]) -> None:
    _report["stacks"][stack][mode]["outcome"] = "pass" if not problems else "fail"
    _report["stacks"][stack][mode]["problems"] = problems


@pytest.fixture(scope="module", autouse=True)
def report():
    """Writes the measurements once the module's tests have run, and prints one line per stack."""
    _report.update(versions=_versions(), python=sys.version.split()[0], stacks={})
    yield _report
    default = os.path.join(ROOT, "reports", "stacks", f"stacks-{_report['versions']['deepspeed']}.json")
    path = os.environ.get("DS_STACK_REPORT") or default
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_report, f, indent=2)
    for stack, modes in _report["stacks"].items():
        line = ", ".join(f"{mode} {m['boundary_backward_syncs']} ({m['wall_s']} s, {m.get('outcome', '?')})"
                         for mode, m in modes.items())
        print(f"\n{stack}: boundary-backward syncs by rank: {line}", file=sys.stderr)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("stacks"))


def _needs(stack: str) -> None:
    for library in STACKS[stack][0]:
        pytest.importorskip(library)


def _training_problems(run: Dict[str, Any]) -> List[str]:
    """What is wrong with a run before its numbers can be compared: exit code, missing ranks, not the setup under
    test, not every step seen."""
    problems = []
    if run["returncode"] != 0:
        problems.append(f"exit {run['returncode']}: {run['output'][-3000:]}")
    if sorted(run["ranks"]) != list(range(WORLD_SIZE)):
        problems.append(f"probe reports from ranks {sorted(run['ranks'])}, not 0-{WORLD_SIZE - 1}")
    for rank, found in sorted(run["ranks"].items()):
        engine = {key: found["engine"].get(key) for key in ENGINE}
        if engine != ENGINE:
            problems.append(f"rank {rank}: the engine is {engine}, not {ENGINE}")
        if len(found["steps"]) != STEPS or len(found["boundary_backward_syncs"]) != STEPS:
            problems.append(f"rank {rank}: {len(found['steps'])} optimizer steps and "
                            f"{len(found['boundary_backward_syncs'])} boundary backwards, not {STEPS}")
    return problems


@pytest.mark.equivalence
@pytest.mark.parametrize("stack", list(STACKS))
def test_reference_is_unpatched_and_syncs(stack: str, tmp_root: str) -> None:
    """Disabled, the package leaves DeepSpeed's methods alone, and every boundary backward on every rank syncs."""
    _needs(stack)
    run = launch(stack, REFERENCE, tmp_root)
    problems = _training_problems(run)
    for rank, found in sorted(run["ranks"].items()):
        if found["patch_state"] != "disabled":
            problems.append(f"rank {rank}: state {found['patch_state']!r}, not 'disabled'")
        if set(found["methods"].values()) != {ORIGINAL_MODULE}:
            problems.append(f"rank {rank}: methods from {found['methods']}, not all {ORIGINAL_MODULE}")
        if not all(count > 0 for count in found["boundary_backward_syncs"]):
            problems.append(f"rank {rank}: boundary-backward syncs {found['boundary_backward_syncs']}, "
                            "expected some in each (the unpatched tracker)")
    _set_outcome(stack, REFERENCE, problems)
    assert not problems, "\n".join(problems)


@pytest.mark.fails_unpatched
@pytest.mark.parametrize("mode", PATCHED_MODES)
@pytest.mark.parametrize("stack", list(STACKS))
def test_patched_has_no_boundary_sync_and_trains_identically(stack: str, mode: str, tmp_root: str) -> None:
    """Patched through ``ds-offload-patch run`` or a plain import: applied on every rank, no host sync in any
    boundary backward, and every step's losses and parameters bit-identical to the reference run's. Follows
    ``DS_OFFLOAD_PATCH_DISABLE``: with the patch disabled it fails (before launching the reference, as there is
    nothing to compare)."""
    _needs(stack)
    run = launch(stack, mode, tmp_root)
    problems = _training_problems(run)
    for rank, found in sorted(run["ranks"].items()):
        if found["patch_state"] != "applied":
            problems.append(f"rank {rank}: state {found['patch_state']!r}, not 'applied'")
        if set(found["methods"].values()) != {PATCHED_MODULE}:
            problems.append(f"rank {rank}: methods from {found['methods']}, not all {PATCHED_MODULE}")
        if any(count != 0 for count in found["boundary_backward_syncs"]):
            problems.append(f"rank {rank}: boundary-backward syncs {found['boundary_backward_syncs']}, not all 0")
    if problems:
        _set_outcome(stack, mode, problems)
        pytest.fail("\n".join(problems))
    reference = launch(stack, REFERENCE, tmp_root)
    if _training_problems(reference):
        pytest.fail(f"the reference run of {stack} failed, nothing to compare with: "
                    f"{_training_problems(reference)[0][:2000]}")
    for rank, found in sorted(run["ranks"].items()):
        expected = reference["ranks"][rank]
        for step, (got, want) in enumerate(zip(found["steps"], expected["steps"]), start=1):
            if got["losses"] != want["losses"]:
                problems.append(f"rank {rank} step {step}: losses {got['losses']}, reference {want['losses']}")
            if got["params_sha256"] != want["params_sha256"]:
                problems.append(f"rank {rank} step {step}: parameters differ from the reference's")
    _set_outcome(stack, mode, problems)
    assert not problems, "\n".join(problems)


def _accumulating_marks() -> tuple:
    from deepspeed_offload_patch.testing.installed import has_defect
    try:
        return (pytest.mark.fails_unpatched, ) if has_defect("grad-accumulation") else ()
    except ImportError:  # no DeepSpeed to ask: the test needs it and says so
        return ()


@pytest.mark.parametrize("steps", [pytest.param(4, id="4-steps", marks=_accumulating_marks())])
def test_accelerate_accumulating_over_4_micro_steps_learns_what_plain_accelerate_learns(steps: int,
                                                                                        tmp_root: str) -> None:
    """The Accelerate loop at ``gradient_accumulation_steps`` 4, ZeRO-2 with the optimizer offloaded, fp32, launched by
    ``accelerate launch`` under ``ds-offload-patch run`` (following ``DS_OFFLOAD_PATCH_DISABLE``), ends with the
    parameters of the same loop run without DeepSpeed (one process: on the CPU, Accelerate counts one process beside
    DeepSpeed and every rank reads every batch, so the ranks' mean gradient is that process's). Where DeepSpeed drops
    the micro-batches between the first and the last (0.15.2 - 0.18.x), only the patch makes it so; elsewhere it
    holds patched and unpatched."""
    _needs("accelerate")
    import torch

    out = os.path.join(tmp_root, "accumulation-4")
    os.makedirs(out, exist_ok=True)
    env = {
        "PATH": BIN + os.pathsep + os.environ.get("PATH", ""),
        "LOCAL_SIZE": str(WORLD_SIZE),
        "HF_HOME": os.path.join(tmp_root, "hf-home"),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "DS_OFFLOAD_PATCH_DISABLE": os.environ.get("DS_OFFLOAD_PATCH_DISABLE", "0"),
    }
    script = ["accelerate_train.py", "--grad-accum", "4", "--steps", str(steps)]
    launch_command = [
        os.path.join(BIN, "ds-offload-patch"), "run", "--",
        os.path.join(BIN, "accelerate"), "launch", "--num_processes",
        str(WORLD_SIZE), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port",
        str(free_port()), "--use_deepspeed", "--deepspeed_config_file", "accelerate_ds_config_ga4.json"
    ] + script + ["--save", os.path.join(out, "deepspeed.pt")]
    with cpu_shm.removes_leftovers():
        ran = run_command(launch_command, env=env, cwd=HERE)
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-4000:]
    plain = run_command([sys.executable] + script + ["--save", os.path.join(out, "plain.pt")], env=env, cwd=HERE)
    assert plain.returncode == 0, (plain.stdout + plain.stderr)[-4000:]
    got, want = (torch.load(os.path.join(out, name)) for name in ("deepspeed.pt", "plain.pt"))
    assert sorted(got) == sorted(want)
    worst = max(float((got[name] - want[name]).abs().max()) for name in want)
    assert worst <= 1e-6, f"parameters off by up to {worst:.3g} from the same loop without DeepSpeed"


@pytest.mark.fails_unpatched
def test_the_configs_the_libraries_generate_are_affected_and_fixed() -> None:
    """The HF Trainer and Accelerate configs in ``tests/unit/configs`` are what the installed transformers and
    accelerate generate (``ci/gen_configs.py --check``), and ``ds-offload-patch affected`` on each says the job has
    the host syncs and exits 0: every defect it has is fixed by default here. Follows ``DS_OFFLOAD_PATCH_DISABLE``:
    disabled, ``affected`` exits 1."""
    _needs("accelerate")
    result = run_command([sys.executable, os.path.join(ROOT, "ci", "gen_configs.py"), "--check"], cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    configs = os.path.join(ROOT, "tests", "unit", "configs")
    for name in ("hf_trainer_generated_zero2_offload.json", "accelerate_generated_zero2_offload.json"):
        result = run_command([os.path.join(BIN, "ds-offload-patch"), "affected",
                              os.path.join(configs, name)],
                             env={"DS_OFFLOAD_PATCH_DISABLE": os.environ.get("DS_OFFLOAD_PATCH_DISABLE", "0")})
        assert "a host sync per gradient in each boundary backward: affected" in result.stdout, result.stdout
        assert result.returncode == 0, f"{name}: exit {result.returncode}\n{result.stdout}{result.stderr}"
