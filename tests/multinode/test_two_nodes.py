# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Two nodes on one machine, launched the way DeepSpeed and torchrun launch them (``conftest.py``: a real ``sshd``,
``node-a`` and ``node-b``, 2 slots each; all traffic to 127.0.0.1).

DeepSpeed's multi-node runner (``deepspeed --hostfile --ssh_port --master_addr 127.0.0.1``, pdsh) starts
``deepspeed.launcher.launch`` on each node over ssh. The remote ranks get only the variables whose names start with
``PYTHON`` and the lines of ``.deepspeed_env`` in the job's folder: so each job here writes one, with the probe's
folder and this process's ``DS_OFFLOAD_PATCH_DISABLE`` (which makes the red/green run reach every rank). Each rank
is measured by ``tests/stacks/probe`` (state, the fix's methods, host syncs per boundary backward, losses and a
parameter digest per step) on ``train.py``, or reports whether the patch reached it (``reach.py``, no training).

* the import route and ``ds-offload-patch run``: all 4 ranks ``applied``, 0 host syncs per boundary backward, losses
  and parameters bit-identical to the same job unpatched, which equals the same job on one node (4 ranks);
* ``ds-offload-patch audit`` over the same launch: every rank's report, per node and in total;
* a ``PYTHONPATH`` line in ``.deepspeed_env`` (it replaces the exported one): ``run`` names the file and the fixed
  line, and the fixed line reaches every rank; a rank whose Python cannot import the package says so itself;
* ``torchrun --nnodes 2`` with a c10d rendezvous, two launcher processes: ``run`` on each, and ``audit`` on each
  (each reports its own node's ranks).

    python -m pytest -q tests/multinode
"""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List, Optional

import pytest

from deepspeed_offload_patch.launcher import BOOTSTRAP_DIR
from deepspeed_offload_patch.testing.launch import HANG_GUARD_S, free_port
from unit.common import clean_env, run_command

HERE = os.path.dirname(os.path.abspath(__file__))
PROBE_DIR = os.path.join(os.path.dirname(HERE), "stacks", "probe")
BIN = os.path.dirname(sys.executable)
TRAIN = os.path.join(HERE, "train.py")
REACH = os.path.join(HERE, "reach.py")
WORLD = 4
STEPS = 2
DISABLE = "DS_OFFLOAD_PATCH_DISABLE"
PATCHED_MODULE = "deepspeed_offload_patch.changes.overflow_flag.methods"
ORIGINAL_MODULE = "deepspeed.runtime.zero.stage_1_and_2"

_launches: Dict[str, Dict[str, Any]] = {}


def _switch() -> str:
    """This process's patch switch, for every rank of a patched launch (the red/green run sets it to 1)."""
    return os.environ.get(DISABLE, "0")


def _job(tmp_root: str, name: str, disable: Optional[str], extra: Optional[Dict[str, str]] = None) -> str:
    """A fresh job folder with a ``probe`` folder for the ranks' reports and its ``.deepspeed_env``: the probe's
    folder, ``DS_OFFLOAD_PATCH_DISABLE=disable`` (unless None), DeepSpeed's op cache, and ``extra``."""
    job = os.path.join(tmp_root, name)
    os.makedirs(os.path.join(job, "probe"))
    lines = {"DS_STACK_PROBE_DIR": os.path.join(job, "probe")}
    if disable is not None:
        lines[DISABLE] = disable
    if os.environ.get("TORCH_EXTENSIONS_DIR"):  # where DeepSpeed's JIT-built ops are cached: no rebuild per node
        lines["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
    lines.update(extra or {})
    with open(os.path.join(job, ".deepspeed_env"), "w") as f:
        f.write("".join(f"{key}={value}\n" for key, value in lines.items()))
    return job


def _deepspeed(cluster, script: str, *args: str) -> List[str]:
    return [
        os.path.join(BIN, "deepspeed"), "--hostfile", cluster.hostfile, "--ssh_port",
        str(cluster.port), "--master_addr", "127.0.0.1", "--master_port",
        str(free_port()), script, *args
    ]


def _env(cluster, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The launching node's environment: the cluster's PATH, the probe on PYTHONPATH (exported to every node)."""
    env = dict(cluster.env(), PYTHONPATH=PROBE_DIR, **(extra or {}))
    return env


def _ranks(folder: str) -> Dict[int, Dict[str, Any]]:
    found = {}
    for rank in range(WORLD):
        path = os.path.join(folder, f"rank-{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                found[rank] = json.load(f)
    return found


def _run(name: str, command: List[str], env: Dict[str, str], job: str) -> Dict[str, Any]:
    started = time.monotonic()
    result = run_command(command, env=env, cwd=job)
    run = {
        "returncode": result.returncode,
        "stdout": result.stdout,
        "output": result.stdout + result.stderr,
        "ranks": _ranks(os.path.join(job, "probe")),
        "wall_s": round(time.monotonic() - started, 1),
        "job": job,
    }
    _launches[name] = run
    print(f"{name}: {run['wall_s']} s", file=sys.stderr)
    return run


def _launch(name: str, cluster, tmp_root: str) -> Dict[str, Any]:
    """One of the training launches, run once per module (the tests share them)."""
    if name in _launches:
        return _launches[name]
    if name == "reference":  # two nodes, the package imported but disabled on every rank
        job = _job(tmp_root, name, "1")
        return _run(name, _deepspeed(cluster, TRAIN, "--import-patch"), _env(cluster), job)
    if name == "one-node":  # the same job, 4 ranks on one node (no hostfile, no ssh)
        job = _job(tmp_root, name, "1")
        env = _env(cluster, {"DS_STACK_PROBE_DIR": os.path.join(job, "probe"), DISABLE: "1", "LOCAL_SIZE": str(WORLD)})
        command = [os.path.join(BIN, "deepspeed"), "--num_gpus", str(WORLD), "--master_port", str(free_port()), TRAIN]
        return _run(name, command + ["--import-patch"], env, job)
    if name in ("import", "run"):
        job = _job(tmp_root, name, _switch())
        command = _deepspeed(cluster, TRAIN, *(["--import-patch"] if name == "import" else []))
        if name == "run":
            command = [os.path.join(BIN, "ds-offload-patch"), "run", "--"] + command
        return _run(name, command, _env(cluster), job)
    raise KeyError(name)


def _trained(run: Dict[str, Any]) -> List[str]:
    """What keeps a training launch's numbers from being compared."""
    problems = []
    if run["returncode"] != 0:
        problems.append(f"exit {run['returncode']}: {run['output'][-4000:]}")
    if sorted(run["ranks"]) != list(range(WORLD)):
        problems.append(f"probe reports from ranks {sorted(run['ranks'])}, not 0-{WORLD - 1}: {run['output'][-3000:]}")
    for rank, found in sorted(run["ranks"].items()):
        if found["engine"]["world_size"] != WORLD or len(found["steps"]) != STEPS:
            problems.append(f"rank {rank}: world {found['engine']['world_size']}, {len(found['steps'])} steps")
    return problems


def _patched_problems(run: Dict[str, Any]) -> List[str]:
    problems = _trained(run)
    for rank, found in sorted(run["ranks"].items()):
        if found["patch_state"] != "applied":
            problems.append(f"rank {rank}: state {found['patch_state']!r}, not 'applied'")
        if set(found["methods"].values()) != {PATCHED_MODULE}:
            problems.append(f"rank {rank}: methods from {found['methods']}, not {PATCHED_MODULE}")
        if any(count != 0 for count in found["boundary_backward_syncs"]):
            problems.append(f"rank {rank}: boundary-backward syncs {found['boundary_backward_syncs']}, not all 0")
    return problems


def _same_bits(run: Dict[str, Any], reference: Dict[str, Any], what: str) -> List[str]:
    problems = []
    for rank in range(WORLD):
        for step, (got, want) in enumerate(zip(run["ranks"][rank]["steps"], reference["ranks"][rank]["steps"]), 1):
            if got["losses"] != want["losses"] or got["params_sha256"] != want["params_sha256"]:
                problems.append(f"rank {rank} step {step}: losses {got['losses']} / parameters differ from {what}'s "
                                f"({want['losses']})")
    return problems


def _syncs_by_rank(names: List[str]) -> List[List[int]]:
    return [
        found["boundary_backward_syncs"] for name in names if name in _launches
        for found in _launches[name]["ranks"].values() if "boundary_backward_syncs" in found
    ]


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    """After the module: each launch's wall time and exit code, and per launcher the boundary-backward host syncs of
    every rank, unpatched (the reference) and patched, in ``$DS_MULTINODE_REPORT`` if set (``nox -s multinode``)."""
    yield
    path = os.environ.get("DS_MULTINODE_REPORT")
    # The red/green run (the switch at 1) launches nothing patched: writing would replace the green run's numbers.
    if not path or _switch() == "1":
        return
    sides = {"pdsh": ("reference", ["import", "run"]), "torchrun-c10d": ("reference", ["torchrun-run"])}
    runs = {
        name: {
            "unpatched": {
                "boundary_syncs": _syncs_by_rank([unpatched]),
                "seconds": [_launches[unpatched]["wall_s"]] if unpatched in _launches else []
            },
            "patched": {
                "boundary_syncs": _syncs_by_rank(patched),
                "seconds": [_launches[n]["wall_s"] for n in patched if n in _launches]
            }
        }
        for name, (unpatched, patched) in sides.items()
    }
    launches = {name: {"wall_s": run["wall_s"], "returncode": run["returncode"]} for name, run in _launches.items()}
    versions = {name: importlib.metadata.version(name) for name in ("deepspeed", "torch")}
    with open(path, "w") as f:
        json.dump({"versions": versions, "runs": runs, "launches": launches}, f, indent=2)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("two-nodes"))


def _reach(cluster,
           tmp_root: str,
           name: str,
           disable: Optional[str],
           through_run: bool,
           extra: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """``reach.py`` on both nodes: each rank's state, without training."""
    job = _job(tmp_root, name, disable, extra)
    command = _deepspeed(cluster, REACH, os.path.join(job, "probe"))
    if through_run:
        command = [os.path.join(BIN, "ds-offload-patch"), "run", "--"] + command
    run = _run(name, command, dict(cluster.env()), job)
    assert run["returncode"] == 0, run["output"][-4000:]
    assert sorted(run["ranks"]) == list(range(WORLD)), run["output"][-4000:]
    nodes = {rank: found["node"] for rank, found in run["ranks"].items()}
    assert nodes == {0: 0, 1: 0, 2: 1, 3: 1}, nodes
    return run


@pytest.mark.fails_unpatched
def test_every_rank_on_both_nodes_is_patched(cluster, tmp_root: str) -> None:
    """``ds-offload-patch run -- deepspeed --hostfile ...`` patches the 4 ranks pdsh starts on node-a and node-b (the
    bootstrap travels in the exported PYTHONPATH). The cheapest two-node check (no training): CI's."""
    run = _reach(cluster, tmp_root, "reach-run", _switch(), through_run=True)
    states = {rank: found["state"] for rank, found in run["ranks"].items()}
    assert states == {rank: "applied" for rank in range(WORLD)}, states
    assert "ds-offload-patch run: warning" not in run["output"]


@pytest.mark.equivalence
def test_two_nodes_unpatched_train_as_one_node(cluster, tmp_root: str) -> None:
    """The reference: disabled on every rank of both nodes (the switch in ``.deepspeed_env``), host syncs in every
    boundary backward, and bit for bit the same job on one node with 4 ranks."""
    reference = _launch("reference", cluster, tmp_root)
    one_node = _launch("one-node", cluster, tmp_root)
    problems = _trained(reference) + _trained(one_node)
    for rank, found in sorted(reference["ranks"].items()):
        if found["patch_state"] != "disabled" or set(found["methods"].values()) != {ORIGINAL_MODULE}:
            problems.append(f"rank {rank}: state {found['patch_state']!r}, methods {found['methods']}")
        if not all(count > 0 for count in found["boundary_backward_syncs"]):
            problems.append(f"rank {rank}: boundary-backward syncs {found['boundary_backward_syncs']}, expected some")
    assert not problems, "\n".join(problems)
    assert not _same_bits(reference, one_node, "one node"), "\n".join(_same_bits(reference, one_node, "one node"))


@pytest.mark.fails_unpatched
@pytest.mark.parametrize("route", ["import", "run"])
def test_patched_on_both_nodes_and_bit_identical(cluster, tmp_root: str, route: str) -> None:
    """``import deepspeed_offload_patch`` in the script, or the unchanged script under ``ds-offload-patch run``: on
    all 4 ranks of both nodes ``applied``, the fix's methods, 0 host syncs per boundary backward, and every step's
    losses and parameters bit-identical to the unpatched two-node job (which equals the one-node job)."""
    run = _launch(route, cluster, tmp_root)
    problems = _patched_problems(run)
    assert not problems, "\n".join(problems)
    reference = _launch("reference", cluster, tmp_root)
    assert not _trained(reference), _trained(reference)
    problems = _same_bits(run, reference, "the unpatched job")
    assert not problems, "\n".join(problems)


@pytest.mark.fails_unpatched
def test_audit_reports_every_rank_per_node_and_in_total(cluster, tmp_root: str) -> None:
    """``ds-offload-patch audit -- deepspeed --hostfile ...``: the audit and this process's switch reach the ranks of
    both nodes through PYTHONPATH (no ``.deepspeed_env`` line for them), each writes its report into the command's
    folder (both nodes see it here), and the command prints every rank, each node's sums and the total: 4 of 4 ranks,
    2 nodes, 0 host syncs in every boundary backward, exit 0. Unpatched, ``--max-backward-syncs 0`` fails."""
    job = _job(tmp_root, "audit", None)
    report = os.path.join(job, "audit.json")
    command = [
        os.path.join(BIN, "ds-offload-patch"), "audit", "--steps",
        str(STEPS), "--stop-after", "--max-backward-syncs", "0", "--json", report, "--"
    ] + _deepspeed(cluster, TRAIN)
    run = _run("audit", command, dict(cluster.env(), **{DISABLE: _switch()}), job)
    assert run["returncode"] == 0, run["output"][-6000:]
    with open(report) as f:
        ranks = json.load(f)["runs"]["run"]["ranks"]
    assert {r["rank"]: r["node"] for r in ranks} == {0: 0, 1: 0, 2: 1, 3: 1}, ranks
    for found in ranks:
        assert found["patch_state"] == "applied" and found["world_size"] == WORLD, found
        assert [step["boundary_backward"] for step in found["steps"]] == [0] * STEPS, found["steps"]
    assert "4 of 4 ranks reported, from 2 nodes" in run["stdout"], run["stdout"][-4000:]
    for node, ranks_text in (("0", "0-1"), ("1", "2-3"), ("all", "0-3")):
        row = re.search(rf"^{node} +{ranks_text} +(.*)$", run["stdout"], re.M)
        assert row, f"no row for node {node}: {run['stdout'][-4000:]}"
        assert row.group(1).split()[STEPS:2 * STEPS] == ["0"] * STEPS, row.group(0)  # the boundary backward column
    assert "note:" not in run["stdout"]


def _launcher_bootstrap_path(cwd: str) -> List[str]:
    """``bootstrap_path()`` as ``ds-offload-patch run`` computes it: this interpreter, outside the checkout. In the
    version matrix's virtualenvs the package is installed (the bootstrap in site-packages, no checkout entry) while
    this process imports the checkout's copy, so this process's own answer would differ from the command's."""
    code = ("import os; from deepspeed_offload_patch.launcher import bootstrap_path; "
            "print(os.pathsep.join(bootstrap_path()))")
    result = run_command([sys.executable, "-c", code], cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip().splitlines()[-1].split(os.pathsep)


@pytest.mark.fails_unpatched
def test_a_pythonpath_line_in_deepspeed_env_is_named_and_its_fix_reaches_every_rank(cluster, tmp_root: str) -> None:
    """A job whose ``.deepspeed_env`` sets its own PYTHONPATH: DeepSpeed's runner exports that line to every node in
    place of the one ``ds-offload-patch run`` set, so no rank finds the bootstrap (none is patched, and none can say
    so). ``run`` names the file and prints the fixed line before launching; with that line every rank is patched."""
    own = os.path.join(tmp_root, "own-code")
    os.makedirs(own)
    run = _reach(cluster, tmp_root, "reach-own-pythonpath", _switch(), through_run=True, extra={"PYTHONPATH": own})
    states = {rank: found["state"] for rank, found in run["ranks"].items()}
    assert states == {rank: "not loaded" for rank in range(WORLD)}, states
    env_file = os.path.join(run["job"], ".deepspeed_env")
    assert f"ds-offload-patch run: warning: {env_file} sets PYTHONPATH" in run["output"], run["output"][-4000:]
    fixed = re.search(r"^PYTHONPATH=(\S+)$", run["output"], re.M).group(1)
    assert fixed == os.pathsep.join(_launcher_bootstrap_path(tmp_root) + [own]), fixed
    run = _reach(cluster, tmp_root, "reach-fixed-pythonpath", _switch(), through_run=True, extra={"PYTHONPATH": fixed})
    states = {rank: found["state"] for rank, found in run["ranks"].items()}
    assert "ds-offload-patch run: warning" not in run["output"], run["output"][-4000:]
    assert states == {rank: "applied" for rank in range(WORLD)}, states


def test_a_rank_that_cannot_import_the_package_says_so(cluster, tmp_root: str) -> None:
    """The bootstrap reaches a rank (here through a ``.deepspeed_env`` line) but the package does not import there:
    a node with another, broken copy first on its path stands in for one where it is installed elsewhere or not at
    all. Every rank, on both nodes, prints one line naming itself, its host, the error and what to do, and trains
    on unpatched."""
    other = os.path.join(tmp_root, "other-install")
    os.makedirs(os.path.join(other, "deepspeed_offload_patch"))
    with open(os.path.join(other, "deepspeed_offload_patch", "__init__.py"), "w") as f:
        f.write("raise ImportError('not the package this job was launched with')\n")
    run = _reach(cluster,
                 tmp_root,
                 "reach-other-install",
                 None,
                 through_run=False,
                 extra={"PYTHONPATH": os.pathsep.join([BOOTSTRAP_DIR, other])})
    states = {rank: found["state"] for rank, found in run["ranks"].items()}
    assert states == {rank: "not loaded" for rank in range(WORLD)}, states
    for rank in range(WORLD):
        line = (f"[deepspeed_offload_patch] bootstrap: rank {rank} on {run['ranks'][rank]['host']}: the patch was not "
                f"loaded: ImportError('not the package this job was launched with'). It runs unpatched.")
        assert line in run["output"], run["output"][-4000:]
    assert "import deepspeed_offload_patch in the training script" in run["output"]


def _torchrun_pair(name: str, tmp_root: str, prefix, env: Dict[str, str]) -> Dict[str, Any]:
    """Two ``torchrun --nnodes 2`` launchers (``--node-rank`` 0 and 1; the c10d rendezvous numbers the nodes in the
    order they join) meeting at a c10d rendezvous on 127.0.0.1, each behind ``prefix(node)`` (``ds-offload-patch run --`` or an audit command), as two nodes would start them."""
    job = _job(tmp_root, name, None)
    port = free_port()
    env = clean_env(dict(env, DS_STACK_PROBE_DIR=os.path.join(job, "probe"), LOCAL_SIZE="2"))
    processes, logs = [], []
    started = time.monotonic()
    for node in (0, 1):
        command = prefix(node, job) + [
            os.path.join(BIN, "torchrun"), "--nnodes", "2", "--node-rank",
            str(node), "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", name, "--local-addr", "127.0.0.1", TRAIN
        ]
        logs.append(open(os.path.join(job, f"node-{node}.log"), "w+"))
        processes.append(subprocess.Popen(command, env=env, cwd=job, stdout=logs[-1], stderr=subprocess.STDOUT))
    codes = []
    try:
        for process in processes:
            codes.append(process.wait(timeout=max(1.0, HANG_GUARD_S - (time.monotonic() - started))))
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
            process.wait()
        pytest.fail(f"hang guard: the two torchrun launchers of {name} did not finish within {HANG_GUARD_S:.0f} s")
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    run = {
        "returncode": max(codes),
        "codes": codes,
        "outputs": outputs,
        "output": "\n".join(outputs),
        "ranks": _ranks(os.path.join(job, "probe")),
        "wall_s": round(time.monotonic() - started, 1),
        "job": job
    }
    _launches[name] = run
    print(f"{name}: {run['wall_s']} s", file=sys.stderr)
    return run


def _torchrun_env(cluster) -> Dict[str, str]:
    return _env(cluster, {DISABLE: _switch()})


@pytest.mark.fails_unpatched
def test_torchrun_two_nodes_patched_and_bit_identical(cluster, tmp_root: str) -> None:
    """``ds-offload-patch run -- torchrun --nnodes 2 --node-rank N ...`` on each "node": all 4 ranks ``applied``,
    0 host syncs per boundary backward, bit-identical to the unpatched two-node job of DeepSpeed's launcher."""
    run = _torchrun_pair("torchrun-run",
                         tmp_root, lambda node, job: [os.path.join(BIN, "ds-offload-patch"), "run", "--"],
                         _torchrun_env(cluster))
    problems = _patched_problems(run)
    assert not problems, "\n".join(problems)
    reference = _launch("reference", cluster, tmp_root)
    assert not _trained(reference), _trained(reference)
    problems = _same_bits(run, reference, "the unpatched job")
    assert not problems, "\n".join(problems)


@pytest.mark.fails_unpatched
def test_torchrun_audit_on_each_node_reports_that_node(cluster, tmp_root: str) -> None:
    """An audit command per node (each node runs its own launcher): each reports its own node's 2 ranks, its node's
    sums, and a note that 2 of the 4 ranks reported; exit 0 with ``--max-backward-syncs 0``."""

    def audit(node: int, job: str) -> List[str]:
        return [
            os.path.join(BIN, "ds-offload-patch"), "audit", "--steps",
            str(STEPS), "--max-backward-syncs", "0", "--json",
            os.path.join(job, f"audit-{node}.json"), "--"
        ]

    # Without the probe on PYTHONPATH: the audit would count the probe's own reads.
    run = _torchrun_pair("torchrun-audit", tmp_root, audit, dict(cluster.env(), **{DISABLE: _switch()}))
    seen = {}
    for launcher, output in enumerate(run["outputs"]):
        assert run["codes"][launcher] == 0, output[-6000:]
        with open(os.path.join(run["job"], f"audit-{launcher}.json")) as f:
            ranks = json.load(f)["runs"]["run"]["ranks"]
        # The c10d rendezvous numbers the nodes in the order they join, whatever --node-rank says.
        node = ranks[0]["node"]
        assert {r["rank"]: r["node"] for r in ranks} == {2 * node: node, 2 * node + 1: node}, ranks
        seen.update((r["rank"], launcher) for r in ranks)
        assert all(r["patch_state"] == "applied" for r in ranks), ranks
        assert "2 of 4 ranks reported, from 1 node" in output, output[-4000:]
        assert "reports come from 2 of 4 ranks" in output, output[-4000:]
    assert sorted(seen) == list(range(WORLD)), seen
