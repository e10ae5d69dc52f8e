# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""8 ranks on two nodes, launched as a user launches them: ``deepspeed --hostfile`` (2 nodes x 4 slots; pdsh over
``conftest.py``'s real ``sshd``) ``--master_addr 127.0.0.1``, ``LOCAL_SIZE=4``, running ``eight_ranks_train.py``:
4 data-parallel x 2 model-parallel ranks with a Megatron-shaped ``mpu``, ZeRO-1 and ZeRO-2 offload, bf16 and fp16,
one inf or NaN per run in one micro-batch on one rank (:data:`eight_ranks_train.RUNS`).

The remote ranks get only ``PYTHON*`` variables and ``.deepspeed_env``'s lines, so each launch writes every switch of
its side (``testing.equivalence.side_env``) there. Three launches at most, each training all 4 runs: the one as this
process's switch says (``fails_unpatched``: 0 host syncs in every boundary backward of every rank), then patched and
unpatched processes (``equivalence``: the patched one is the first where the switch is on), compared bit for bit on
every rank and step; the red/green run (``DS_OFFLOAD_PATCH_DISABLE=1``, equivalence tests left out) launches once.

With ``DS_MULTINODE_EIGHT_REPORT`` set (``nox -s multinode``), the host syncs per boundary backward of every rank,
unpatched and patched, and each launch's wall time go there.

    python -m pytest -q tests/multinode/test_eight_ranks.py
"""

import json
import os
import pickle
import sys
import time
from typing import Any, Dict, Iterator, List

import pytest

from deepspeed_offload_patch.testing.equivalence import (CURRENT, PATCHED, UNPATCHED, differences, fault_problems,
                                                         side_env)
from deepspeed_offload_patch.testing.launch import free_port
from eight_ranks_train import FAULT_STEP, MODEL_PARALLEL, RUNS, STEPS, WORLD
from unit.common import run_command

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)
SCRIPT = os.path.join(HERE, "eight_ranks_train.py")
SLOTS = 4
NODES = ("node-a", "node-b")
DISABLE = "DS_OFFLOAD_PATCH_DISABLE"

_launches: Dict[str, Dict[str, Any]] = {}


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("eight-ranks"))


def _hostfile(cluster, tmp_root: str) -> str:
    """The cluster's two host names with 4 slots each (the fixture's own hostfile gives 2)."""
    path = os.path.join(tmp_root, "hostfile")
    with open(path, "w") as f:
        f.write("".join(f"{host} slots={SLOTS}\n" for host in NODES))
    return path


def _launch(side: str, cluster, tmp_root: str) -> Dict[str, Any]:
    """``eight_ranks_train.py`` on 2 nodes x 4 ranks with ``side``'s switches, once per module and side; returns the
    exit code, output, wall time and each rank's result (by rank). A failed launch fails the test with its output."""
    if side in _launches:
        return _launches[side]
    job = os.path.join(tmp_root, side)
    out = os.path.join(job, "out")
    os.makedirs(out)
    switches = side_env(side)
    lines = dict(switches, LOCAL_SIZE=str(SLOTS))
    if os.environ.get("TORCH_EXTENSIONS_DIR"):  # DeepSpeed's JIT-built ops: the cache of this checkout on every node
        lines["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
    with open(os.path.join(job, ".deepspeed_env"), "w") as f:
        f.write("".join(f"{key}={value}\n" for key, value in lines.items()))
    command = [
        os.path.join(BIN, "deepspeed"), "--hostfile",
        _hostfile(cluster, tmp_root), "--ssh_port",
        str(cluster.port), "--master_addr", "127.0.0.1", "--master_port",
        str(free_port()), SCRIPT, "--out", out
    ]
    started = time.monotonic()
    result = run_command(command, env=dict(cluster.env(), LOCAL_SIZE=str(SLOTS), **switches), cwd=job)
    ranks = {}
    for rank in range(WORLD):
        path = os.path.join(out, f"rank-{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                ranks[rank] = pickle.load(f)
    run = {
        "returncode": result.returncode,
        "output": result.stdout + result.stderr,
        "ranks": ranks,
        "wall_s": round(time.monotonic() - started, 1),
    }
    _launches[side] = run
    print(f"8 ranks, {side}: {run['wall_s']} s", file=sys.stderr)
    if run["returncode"] != 0 or sorted(ranks) != list(range(WORLD)):
        pytest.fail(f"the {side} launch: exit {run['returncode']}, results from ranks {sorted(ranks)} of {WORLD}:\n"
                    f"{run['output'][-6000:]}")
    return run


def _results(run: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The ranks' results in rank order, as ``testing.equivalence.differences`` and ``fault_problems`` read them."""
    return [run["ranks"][rank] for rank in range(WORLD)]


def _syncs(run: Dict[str, Any], name: str) -> List[List[int]]:
    return [[step["boundary_syncs"] for step in run["ranks"][rank]["runs"][name]["steps"]] for rank in range(WORLD)]


@pytest.fixture(scope="module")
def current(cluster, tmp_root: str) -> Dict[str, Any]:
    """The launch with the patch as this process's ``DS_OFFLOAD_PATCH_DISABLE`` says."""
    return _launch(CURRENT, cluster, tmp_root)


@pytest.fixture(scope="module")
def sides(cluster, tmp_root: str) -> Dict[str, Dict[str, Any]]:
    """Patched and unpatched launches (the current one is the patched one when the switch is on)."""
    patched = CURRENT if side_env(CURRENT) == side_env(PATCHED) else PATCHED
    return {PATCHED: _launch(patched, cluster, tmp_root), UNPATCHED: _launch(UNPATCHED, cluster, tmp_root)}


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    """After the module: per run and side, every rank's host syncs per boundary backward and seconds, and each
    launch's wall time, in ``$DS_MULTINODE_EIGHT_REPORT`` if set (``nox -s multinode``)."""
    yield
    path = os.environ.get("DS_MULTINODE_EIGHT_REPORT")
    # The red/green run launches nothing patched: writing would replace the green run's numbers.
    if not path or side_env(CURRENT) != side_env(PATCHED):
        return
    names = {PATCHED: CURRENT, UNPATCHED: UNPATCHED}
    found = {side: _launches[name] for side, name in names.items() if name in _launches}
    runs = {
        f"8 ranks {run.name}": {
            side: {
                "boundary_syncs": _syncs(launch, run.name),
                "seconds": [round(launch["ranks"][rank]["runs"][run.name]["seconds"], 1) for rank in range(WORLD)],
            }
            for side, launch in found.items() if sorted(launch["ranks"]) == list(range(WORLD))
        }
        for run in RUNS
    }
    launches = {
        f"8 ranks {name}": {
            "wall_s": launch["wall_s"],
            "returncode": launch["returncode"]
        }
        for name, launch in _launches.items()
    }
    found_runs = {name: sides for name, sides in runs.items() if sides}
    with open(path, "w") as f:
        json.dump({"world_size": WORLD, "runs": found_runs, "launches": launches}, f, indent=2)


@pytest.mark.fails_unpatched
def test_every_rank_of_both_nodes_makes_no_host_sync_in_the_boundary_backward(current) -> None:
    """All 8 ranks, every run (ZeRO-1/2 x bf16/fp16) and step: 0 host syncs counted in the boundary backward, and the
    package ``applied`` on every rank. Unpatched, every rank reads the host once per gradient tensor it owns."""
    problems = []
    for run in RUNS:
        for rank, counts in enumerate(_syncs(current, run.name)):
            if len(counts) != STEPS or any(counts):
                problems.append(f"{run.name}, rank {rank}: host syncs per boundary backward {counts}, not 0")
    states = {rank: found["state"] for rank, found in current["ranks"].items()}
    if set(states.values()) != {"applied"}:
        problems.append(f"states by rank: {states}")
    assert not problems, "\n".join(problems)


@pytest.mark.equivalence
def test_two_nodes_of_four_ranks_in_four_data_parallel_by_two_model_parallel_groups(sides) -> None:
    """Ranks 0-3 on the first node and 4-7 on the second (the launcher's node rank), 4 local ranks each; the
    model-parallel groups adjacent pairs and the data-parallel groups strided over both nodes, in every run, patched
    and unpatched."""
    for side, launch in sides.items():
        for rank, found in launch["ranks"].items():
            assert (found["node"], found["local_rank"], found["world_size"]) == (rank // SLOTS, rank % SLOTS, WORLD), \
                (side, rank, found["node"], found["local_rank"])
            first = rank - rank % MODEL_PARALLEL
            for run in RUNS:
                groups = found["runs"][run.name]["groups"]
                assert groups["model_parallel"] == list(range(first, first + MODEL_PARALLEL)), (side, rank, groups)
                assert groups["data_parallel"] == [list(range(rank % MODEL_PARALLEL, WORLD, MODEL_PARALLEL))], \
                    (side, rank, groups)
                assert found["runs"][run.name]["optimizer"] == "DeepSpeedZeroOptimizer"


@pytest.mark.equivalence
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_patched_and_unpatched_train_the_same_bits_on_every_rank(sides, run) -> None:
    """Every rank, every step: the overflow flag before ``step()``, the parameters and fp32 master partitions bit for
    bit, the skipped steps, ``optimizer.overflow``, the loss scale state and the gradient norm, with their types; the
    patched processes ``applied`` and the unpatched ones ``disabled``."""
    assert {found["state"] for found in sides[PATCHED]["ranks"].values()} == {"applied"}
    assert {found["state"] for found in sides[UNPATCHED]["ranks"].values()} == {"disabled"}
    found = differences(_results(sides[PATCHED]), _results(sides[UNPATCHED]), run.name)
    assert not found, "\n".join(found[:10])


@pytest.mark.equivalence
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_all_eight_ranks_skip_exactly_the_faulty_step(sides, run) -> None:
    """One inf or NaN on one rank makes all 8 ranks, of both nodes and both model-parallel halves, skip that step and
    only it (no NaN in any parameter), and the next step trains: patched and unpatched alike."""
    for side, launch in sides.items():
        problems = fault_problems(run, _results(launch))
        assert not problems, f"{side}: " + "\n".join(problems)
        for rank, found in launch["ranks"].items():
            steps = found["runs"][run.name]["steps"]
            assert [s["skipped"] for s in steps] == [0] * FAULT_STEP + [1] * (STEPS - FAULT_STEP), (side, rank)
            changed = [
                name for name, bits in steps[-1]["params"].items()
                if not bool((bits == steps[FAULT_STEP]["params"][name]).all())
            ]
            assert changed, f"{side}, rank {rank}: no parameter changed in the step after the skipped one"


@pytest.mark.equivalence
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_unpatched_every_rank_reads_the_host_in_the_boundary_backward(sides, run) -> None:
    """What the patch removes is there on this layout: unpatched, every rank of both nodes makes host syncs in every
    boundary backward."""
    syncs = _syncs(sides[UNPATCHED], run.name)
    assert all(count > 0 for counts in syncs for count in counts), syncs
