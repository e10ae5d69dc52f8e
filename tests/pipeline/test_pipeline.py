# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Pipeline parallelism: DeepSpeed's ``PipelineEngine`` with 2 stages x 2 data-parallel ranks (4 ranks), ZeRO-1 with
the optimizer offloaded to the CPU, ``train_batch()`` with 2 micro-batches, bf16 (check on) and fp16 (dynamic loss
scaling), an inf or a NaN in one micro-batch's backward on one rank (``pipe_train.py``).

The pipeline engine turns the backward's all-reduce off and schedules it: ZeRO-1 reduces the gradients, and with
offload checks each one for inf/NaN, in the ``ReduceGrads`` instruction, not in the backward passes. So the host syncs
the patch removes are counted in every ``BackwardPass`` and in ``ReduceGrads`` and ``ReduceTiedGrads``.

* ``fails_unpatched``: with the patch as this process's switch says, 0 host syncs in those instructions on every rank
  and step (unpatched: one per gradient tensor of the rank's partition, in ``ReduceGrads``); and
  ``ds-offload-patch audit`` counting ``train_batch()`` per optimizer step passes ``--max-backward-syncs 0``.
* ``equivalence``: patched and unpatched processes train the same bits on every rank (the stage's parameters, the
  fp32 master partitions, the loss, the loss scale, the gradient norm, ``optimizer.overflow``) and skip the same
  steps, exactly the faulty one, on all four ranks; unpatched, the syncs are in ``ReduceGrads`` and nowhere in the
  backward passes; the audit of an unpatched run puts them in the ``ReduceGrads`` phase and fails the budget there.
"""

import json
import os
import re
import sys

import pytest

from deepspeed_offload_patch import GOOD_STATES
from deepspeed_offload_patch.testing.equivalence import CURRENT, PATCHED, UNPATCHED, both_sides, differences, side_env
from deepspeed_offload_patch.testing.launch import free_port, run_distributed
from pipe_train import STAGES, WORLD, PipeRun, trace_pipeline
from unit.common import assert_ok, run_command

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

STEPS = 4
# (step, micro-batch, global rank, value): rank 1 is stage 0 of data-parallel replica 1, rank 2 stage 1 of replica 0.
RUNS = (
    PipeRun("bf16-inf", precision="bf16", steps=STEPS, fault=(1, 0, 1, "inf")),
    PipeRun("fp16-nan", precision="fp16", steps=STEPS, fault=(2, 1, 2, "nan")),
)
BOUNDARY = ("BackwardPass", "ReduceTiedGrads", "ReduceGrads")
REPORT = os.path.join(ROOT, "reports", "pipeline")
AUDIT_STEPS = 2


def _train(side: str) -> list:
    return run_distributed(trace_pipeline, WORLD, args=(RUNS, ), env=side_env(side), fork_server=True)


@pytest.fixture(scope="module")
def current():
    """Every run, patched or not as ``DS_OFFLOAD_PATCH_DISABLE`` says."""
    return _train(CURRENT)


@pytest.fixture(scope="module")
def sides(current):
    """Every run in patched and in unpatched processes (the current run is the patched one when the switch is on)."""
    found = both_sides(_train, current)
    _report(found)
    return found


def _syncs(result: list, run: str) -> list:
    """Per rank, per step: the host syncs counted in each instruction of :data:`pipe_train.COUNTED`."""
    return [[step["boundary_syncs"] for step in rank["runs"][run]["steps"]] for rank in result]


def _report(sides) -> None:
    """For the nox session's layout report (``ci/matrix_table.py``'s table): per run and side, the host syncs per rank
    and step in the boundary's instructions (the backward passes, ``ReduceTiedGrads``, ``ReduceGrads``) and each
    rank's seconds; and each instruction's count."""
    import deepspeed

    os.makedirs(REPORT, exist_ok=True)
    runs = {
        run.name: {
            side: {
                "boundary_syncs": [[sum(step[name] for name in BOUNDARY) for step in rank]
                                   for rank in _syncs(result, run.name)],
                "seconds": [round(rank["runs"][run.name]["seconds"], 1) for rank in result],
                "instructions":
                _syncs(result, run.name),
            }
            for side, result in sides.items()
        }
        for run in RUNS
    }
    with open(os.path.join(REPORT, f"{deepspeed.__version__}.json"), "w") as f:
        json.dump({"deepspeed": deepspeed.__version__, "world_size": WORLD, "runs": runs}, f, indent=1)


@pytest.mark.fails_unpatched
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_backward_and_reduce_grads_make_no_host_sync(current, run):
    syncs = _syncs(current, run.name)
    assert len(syncs) == WORLD and all(len(rank) == STEPS for rank in syncs), syncs
    boundary = [[sum(step[name] for name in BOUNDARY) for step in rank] for rank in syncs]
    assert all(count == 0 for rank in boundary for count in rank), f"{run.name}: per rank, per step: {syncs}"


@pytest.mark.equivalence
def test_the_layout_is_2_stages_by_2_data_parallel_ranks(sides):
    """Rank r is stage r // 2 of data-parallel replica r % 2; ZeRO-1 partitions over the stage's 2 replicas."""
    for result in sides.values():
        for rank, found in enumerate(result):
            assert found["state"] in GOOD_STATES + ("disabled", ), found["state"]
            for run in RUNS:
                trace = found["runs"][run.name]
                assert (trace["stage"], trace["dp"]) == (rank // STAGES, rank % STAGES), (rank, trace["stage"])
                assert trace["optimizer"] == "DeepSpeedZeroOptimizer", trace["optimizer"]
                first = rank - rank % STAGES
                assert trace["groups"] == {"data_parallel": [first, first + 1], "pipe": [rank % 2, rank % 2 + 2]}


@pytest.mark.equivalence
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_patched_and_unpatched_train_the_same_bits(sides, run):
    found = differences(sides[PATCHED], sides[UNPATCHED], run.name)
    assert not found, "\n".join(found[:10])


@pytest.mark.equivalence
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_every_rank_skips_exactly_the_faulty_step(sides, run):
    """A fault in one micro-batch on one rank makes all four ranks, both stages, skip that step, and only it, patched
    and unpatched; no NaN reaches a parameter and the steps after it train."""
    fault_step = run.fault[0]
    for side, result in sides.items():
        for rank, found in enumerate(result):
            steps = found["runs"][run.name]["steps"]
            skipped = [s["skipped"] for s in steps]
            assert skipped == [0] * fault_step + [1] * (STEPS - fault_step), (side, rank, skipped)
            assert not any(s["nan_params"] for s in steps), (side, rank)
            assert steps[fault_step]["params"].keys() == steps[-1]["params"].keys()
            changed = [
                name for name, bits in steps[-1]["params"].items()
                if not (bits == steps[fault_step]["params"][name]).all()
            ]
            assert changed, f"{side}, rank {rank}: no parameter changed after the skipped step"


@pytest.mark.equivalence
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_unpatched_syncs_are_in_reduce_grads(sides, run):
    """Where the pipeline really syncs: unpatched, ZeRO-1's tracker reads the host in ``ReduceGrads``, once per
    gradient tensor of the rank's partition (2 of each stage's 4), in every step; never in a backward pass."""
    for rank in _syncs(sides[UNPATCHED], run.name):
        assert [step["ReduceGrads"] for step in rank] == [2] * STEPS, rank
        assert all(step["BackwardPass"] == 0 and step["ReduceTiedGrads"] == 0 for step in rank), rank


def _audit(tmp_path, *options, env=None):
    """``ds-offload-patch audit OPTIONS -- deepspeed --num_gpus 4 pipe_train.py`` in ``tmp_path``, with this
    interpreter's launchers first on PATH and a free rendezvous port (another job on the machine may hold DeepSpeed's
    default); returns (the command's result, its --json report, or None where none was written)."""
    report = tmp_path / "audit.json"
    env = dict(env or {})
    env.update({"LOCAL_SIZE": str(WORLD), "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]})
    command = [
        sys.executable, "-m", "deepspeed_offload_patch", "audit", "--steps",
        str(AUDIT_STEPS), "--stop-after", "--json",
        str(report), *options, "--", "deepspeed", "--num_gpus",
        str(WORLD), "--master_port",
        str(free_port()),
        os.path.join(HERE, "pipe_train.py"), "--steps", "4"
    ]
    result = run_command(command, env=env, cwd=str(tmp_path))
    return result, (json.loads(report.read_text()) if report.exists() else None)


def _column(report, phase):
    return [step[phase] for step in report["steps"]]


def _assert_pipeline_reports(ranks, reduce_grads: int) -> None:
    assert [r["rank"] for r in ranks] == list(range(WORLD)), ranks
    for report in ranks:
        assert report["engine"] == "pipeline" and report["complete"], report
        assert report["phases"] == ["forward", "backward", "reduce_grads", "pipe_comm", "optimizer_step",
                                    "other"], report
        assert _column(report, "reduce_grads") == [reduce_grads] * AUDIT_STEPS, report
        assert _column(report, "backward") == [0] * AUDIT_STEPS, report
        assert len(_column(report, "optimizer_step")) == AUDIT_STEPS


@pytest.mark.fails_unpatched
def test_audit_counts_each_train_batch_as_an_optimizer_step(tmp_path):
    """The audit under the pipeline engine, patched as this process's switch says: each ``train_batch()`` is one
    optimizer step split into the pipeline's phases, and the backward passes and ``ReduceGrads`` make no host sync."""
    result, found = _audit(tmp_path, "--max-backward-syncs", "0", env=side_env(CURRENT))
    output = assert_ok(result)
    _assert_pipeline_reports(found["runs"]["run"]["ranks"], reduce_grads=0)
    assert re.search(
        r"^ *rank +forward +backward +ReduceGrads +load, send, recv +OptimizerStep +rest of train_batch "
        r"+whole step$", output, re.M), output
    assert output.count(f"stopping after {AUDIT_STEPS} counted steps") == WORLD, output
    assert "audit: OK: every rank within --max-backward-syncs 0" in output


@pytest.mark.equivalence
def test_audit_finds_the_unpatched_syncs_in_reduce_grads(tmp_path):
    """Unpatched, the audit names ``ReduceGrads`` and ZeRO-1's tracker line for each rank's 2 host syncs per step, and
    ``--max-backward-syncs 0`` fails there."""
    result, found = _audit(tmp_path, "--max-backward-syncs", "0", env=side_env(UNPATCHED))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = found["runs"]["run"]["ranks"]
    _assert_pipeline_reports(ranks, reduce_grads=2)
    for report in ranks:
        assert report["patch_state"] == "disabled"
        top = report["top"]["reduce_grads"][0]
        assert "stage_1_and_2.py:" in top["line"] and top["count"] == 2 * AUDIT_STEPS, top
    fails = [line for line in result.stdout.splitlines() if "audit: FAIL: ReduceGrads: rank" in line]
    assert len(fails) == WORLD and all("stage_1_and_2.py:" in line for line in fails), result.stdout[-3000:]


@pytest.mark.equivalence
def test_docs_audit_md_s_pipeline_transcript_is_what_the_command_prints():
    """docs/audit.md's pipeline transcript (too slow for the default suite's document run: 4 ranks, twice) runs here:
    its command, in the checkout, must print the table rows and the OK line the document shows."""
    with open(os.path.join(ROOT, "docs", "audit.md")) as f:
        block = f.read().split("```text\n$ ", 1)[1].split("```", 1)[0]
    command_lines, shown = [], block.splitlines()
    while command_lines == [] or command_lines[-1].endswith("\\"):
        command_lines.append(shown.pop(0))
    command = " ".join(line.rstrip("\\").strip() for line in command_lines)
    env = {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    output = assert_ok(run_command(["bash", "-c", command], env=env, cwd=ROOT))
    rows = [line.rstrip() for line in shown if re.match(r"^(unpatched|patched) +\d", line) or " audit: OK" in line]
    printed = [line.rstrip() for line in output.splitlines()]
    assert len(rows) == 2 * WORLD + 1 and all(row in printed for row in rows), (rows, output[-4000:])
