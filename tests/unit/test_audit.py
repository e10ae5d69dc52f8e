# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""``ds-offload-patch audit``: host syncs per phase in the ranks of an unmodified training script, started by the
``deepspeed`` launcher and by ``torchrun``; the budgets; ``--compare``; and an audited run that trains exactly like an
unaudited one."""

import json
import os
import re
import shutil
import sys

import pytest

from deepspeed_offload_patch import settings
from deepspeed_offload_patch.audit import report as audit_report
from unit.common import HANG_GUARD_S, assert_ok, on_free_port, run_command

CLI = [sys.executable, "-m", "deepspeed_offload_patch"]
TENSORS = 40  # ci/smoke_train.py's default: 20 Linear layers, 20 tensors in each rank's partition
DISABLE = "DS_OFFLOAD_PATCH_DISABLE"
WHOLE_STEP_BUDGET = 10  # host syncs per rank and optimizer step, patched, at any size (bench, test_offload_grad_norm)

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ci",
                      "smoke_train.py")

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user_repo")
    shutil.copy(SCRIPT, folder / "train.py")  # the user's repository: a folder with its training script
    return folder


def launched(args, script, env=None, timeout=HANG_GUARD_S):
    """``ds-offload-patch ARGS`` in the user's folder, with this interpreter's launchers first on PATH and the
    launcher's master port a free one."""
    env = dict(env or {})
    env.update({"LOCAL_SIZE": "2", "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")})
    return run_command(CLI + on_free_port(list(args)), env=env, cwd=script, timeout=timeout)


TORCHRUN = ["torchrun", "--nproc_per_node", "2", "train.py"]

# The case itself (`audit --compare` under the `deepspeed` launcher on ci/smoke_train.py: N/2 host syncs per
# rank in the boundary backward unpatched, 0 patched, DeepSpeed's line named) is docs/audit.md's first transcript,
# which the suite runs and compares line by line.


@pytest.mark.equivalence
def test_budget_fails_without_the_patch_and_names_the_tracker_line(script):
    """With the patch disabled, ``--max-backward-syncs 0`` fails, naming the phase, each rank and the tracker line.
    The run ends after one step (fewer than the three asked): what was counted is still reported and checked."""
    result = launched(["audit", "--steps", "3", "--max-backward-syncs", "0", "--", *TORCHRUN, "--steps", "1"],
                      script,
                      env={DISABLE: "1"})
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    for rank in (0, 1):
        assert re.search(
            rf"FAIL: boundary backward: rank {rank} made {TENSORS // 2} host syncs in optimizer step 1 "
            rf"\(budget 0\); top lines: +{TENSORS // 2} +deepspeed/runtime/zero/stage_1_and_2\.py:\d+ ",
            output), output
    assert "first 3 optimizer steps (the run ended after 1)" in output, output


@pytest.mark.fails_unpatched
def test_an_audited_run_trains_exactly_like_an_unaudited_one(script, tmp_path):
    """Counting changes nothing: after 3 steps (2 counted, one with a NaN gradient on rank 0 where DeepSpeed survives
    it) the parameters and the skipped steps equal a run without the audit, bit for bit. The patched backward keeps a budget of 0 host syncs.

    The runs follow this process's patch switch (so ``ci/check_red_green.py`` sees the budget fail unpatched)."""
    import torch

    from deepspeed_offload_patch.testing.equivalence import bad_gradients_survive

    env = {DISABLE: os.environ.get(DISABLE, "0")}
    # DeepSpeed 0.14.0 - 0.17.0 fail in step() on a bad bf16 gradient, patched or not: no NaN there.
    nan = bad_gradients_survive("bf16")
    common = [*TORCHRUN, "--steps", "3", "--nan-step", "1" if nan else "-1"]
    # The whole step (forward, backward, step()) within a budget far below the rank's TENSORS / 2 tensors: with the
    # defaults, step() reads no gradient norm per tensor either.
    audited = launched([
        "audit", "--steps", "2", "--max-backward-syncs", "--max-total-syncs",
        str(WHOLE_STEP_BUDGET), "--", *common, "--save",
        str(tmp_path / "audited")
    ],
                       script,
                       env=env)
    plain = assert_ok(launched(["run", "--", *common, "--save", str(tmp_path / "plain")], script, env=env))
    assert f"rank 0 done: 3 steps, {int(nan)} skipped" in plain, plain
    for rank in (0, 1):
        with_audit = torch.load(tmp_path / f"audited.{rank}")
        without = torch.load(tmp_path / f"plain.{rank}")
        assert with_audit.keys() == without.keys()
        different = [name for name in without if not torch.equal(with_audit[name], without[name])]
        assert not different, f"rank {rank}: {different}"
    output = assert_ok(audited)
    assert f"audit: OK: every rank within --max-backward-syncs 0 --max-total-syncs {WHOLE_STEP_BUDGET}" in output


def test_a_command_without_a_deepspeed_step_fails_the_audit(tmp_path):
    result = run_command(CLI + ["audit", "--", sys.executable, "-c", "import deepspeed; print('imported')"],
                         cwd=tmp_path)
    assert result.returncode == 1 and "imported" in result.stdout, result
    assert "exited with code" not in result.stdout and "counted no DeepSpeed optimizer step" in result.stdout, result


def test_a_failing_command_keeps_its_exit_code(tmp_path):
    result = run_command(CLI + ["audit", "--", sys.executable, "-c", "raise SystemExit(3)"], cwd=tmp_path)
    assert result.returncode == 3, result
    assert result.stdout.splitlines() == ["ds-offload-patch audit: FAIL: the command exited with code 3"], result


@pytest.mark.parametrize("args", [[], ["--max-step-syncs", "-1", "--", "true"], ["--steps", "0", "--", "true"]])
def test_usage_errors(args):
    assert run_command(CLI + ["audit", *args]).returncode == 2


def report(rank, boundary, step, lines=()):
    steps = [{"forward": 0, "boundary_backward": b, "other_backward": 0, "step": s} for b, s in zip(boundary, step)]
    top = {phase: [] for phase in ("forward", "boundary_backward", "other_backward", "step")}
    top["boundary_backward"] = [{"line": line, "op": "aten.item", "count": count} for line, count in lines]
    return {
        "rank": rank,
        "steps": steps,
        "top": top,
        "complete": True,
        "steps_wanted": len(steps),
        "deepspeed_version": "x",
        "patch_state": "applied",
        "cuda_syncs": None
    }


def test_budgets_name_the_worst_step_of_each_rank_and_phase():
    reports = [report(0, [0, 0], [3, 3]), report(1, [0, 7], [3, 4], lines=[("a.py:1 (x)", 10), ("b.py:2 (y)", 4)])]
    assert audit_report.check_budgets(reports, {
        "max_backward_syncs": 0,
        "max_step_syncs": 4
    }) == [
        audit_report.Violation("boundary_backward", 1, 2, 7, 0,
                               ["   10  a.py:1 (x)  aten.item", "    4  b.py:2 (y)  aten.item"])
    ]
    violations = audit_report.check_budgets(reports, {"max_backward_syncs": None, "max_step_syncs": 2})
    assert [(v.phase, v.rank, v.step, v.count) for v in violations] == [("step", 0, 1, 3), ("step", 1, 2, 4)]
    assert "step(): rank 1 made 4 host syncs in optimizer step 2 (budget 2)" in str(violations[1])
    assert audit_report.check_budgets(reports, {"max_backward_syncs": 7, "max_step_syncs": None}) == []


def test_the_whole_step_is_the_sum_of_the_phases_and_has_its_budget():
    reports = [report(0, [0, 0], [3, 3]), report(1, [0, 7], [3, 4], lines=[("a.py:1 (x)", 10)])]
    violations = audit_report.check_budgets(reports, {"max_total_syncs": 10})
    assert [(v.phase, v.rank, v.step, v.count) for v in violations] == [("whole_step", 1, 2, 11)]
    assert str(violations[0]) == ("whole step: rank 1 made 11 host syncs in optimizer step 2 (budget 10); top lines: "
                                  "10  a.py:1 (x)  aten.item"), str(violations[0])
    assert audit_report.check_budgets(reports, {"max_total_syncs": 11}) == []
    printed = audit_report.table(reports).splitlines()
    assert printed[2].split()[-2:] == ["whole", "step"], printed[2]
    assert printed[4].split() == ["1", "0", "0", "0", "7", "0", "0", "3", "4", "3", "11"], printed[4]


def fake_engine_class():
    """A stand-in for DeepSpeedEngine with its accumulation bookkeeping (2 micro-batches per optimizer step) and known
    host reads: none in forward, 3 in the boundary backward, 1 in the other, 1 in the boundary step()."""
    import torch

    class Engine:

        def __init__(self):
            self.micro_steps = 0
            self.global_steps = 0

        def is_gradient_accumulation_boundary(self):
            return (self.micro_steps + 1) % 2 == 0

        def forward(self, x):
            return x * 2

        def backward(self, loss):
            for _ in range(3 if self.is_gradient_accumulation_boundary() else 1):
                bool(loss > 0)

        def step(self):
            if self.is_gradient_accumulation_boundary():
                float(torch.ones(1).sum())
                self.global_steps += 1
            self.micro_steps += 1

    return Engine


@pytest.fixture
def audit_state(tmp_path, monkeypatch):
    """The auditor of this process, counting 2 steps into ``tmp_path``, on a fresh stand-in engine class."""
    import types

    from deepspeed_offload_patch.audit import rank as auditor

    monkeypatch.setenv(settings.AUDIT_DIR, str(tmp_path))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(auditor, "_state", auditor.PhaseCounts(steps=2, top=5))
    monkeypatch.setattr(auditor, "_written", False)
    module = types.SimpleNamespace(DeepSpeedEngine=fake_engine_class())
    auditor.instrument(module)
    auditor.instrument(module)  # idempotent: wrapped once
    assert module.DeepSpeedEngine.step.__ds_offload_patch_audit__.__name__ == "step"
    return auditor, module.DeepSpeedEngine


def train(engine_class, steps):
    import torch

    engine = engine_class()
    for _ in range(2 * steps):
        engine.backward(engine.forward(torch.ones(())))
        engine.step()
    return engine


def test_each_call_counts_in_its_phase_and_counting_stops_after_the_steps(audit_state, tmp_path, capsys):
    auditor, engine_class = audit_state
    engine = train(engine_class, steps=3)
    assert engine.global_steps == 3
    expected = {"forward": 0, "boundary_backward": 3, "other_backward": 1, "step": 1}
    assert auditor._state.steps == [expected, expected] and auditor._state.done
    rank0 = json.loads((tmp_path / "rank-0.json").read_text())
    assert rank0["steps"] == [expected, expected] and rank0["complete"] and rank0["cuda_syncs"] is None
    top = rank0["top"]["boundary_backward"][0]
    assert top["count"] == 6 and top["op"] == "aten._local_scalar_dense" and "bool(loss > 0)" in top["line"], top
    assert json.loads((tmp_path / "report.json").read_text())["ranks"] == [rank0]
    printed = capsys.readouterr().out
    assert re.search(r"^ +0 +0 +0 +3 +3 +1 +1 +1 +1 +5 +5$", printed, re.M), printed


def test_on_several_nodes_no_rank_waits_for_the_others(audit_state, tmp_path, monkeypatch, capsys):
    """Rank 0 of 2 with one rank per node: its file is written, and there is no collective (the other node's ranks
    may not be audited at all) and so no table from rank 0; the audit command reports the ranks it finds."""
    auditor, engine_class = audit_state
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(auditor, "_gather", lambda report: pytest.fail("a collective on several nodes"))
    train(engine_class, steps=2)
    assert json.loads((tmp_path / "rank-0.json").read_text())["world_size"] == 2
    assert not (tmp_path / "report.json").exists() and "host syncs" not in capsys.readouterr().out


def test_a_report_that_cannot_be_written_does_not_stop_training(audit_state, monkeypatch):
    from deepspeed_offload_patch import log

    auditor, engine_class = audit_state
    warnings = []
    monkeypatch.setattr(log, "warn_once", warnings.append)
    monkeypatch.setenv(settings.AUDIT_DIR, "/nonexistent/folder")
    engine = train(engine_class, steps=3)
    assert engine.global_steps == 3 and auditor._state.done
    assert len(warnings) == 1 and "report was not completed" in warnings[0], warnings


def test_cuda_counts_come_from_a_profiler_around_each_call(audit_state, monkeypatch):
    """The CUDA branch on the CPU: a CPU-only profiler stands in for the CUDA one (no cuda*Synchronize, so 0)."""
    from torch.profiler import ProfilerActivity, profile

    auditor, engine_class = audit_state
    started = []
    monkeypatch.setattr(auditor, "_cuda_profiler",
                        lambda: started.append(1) or profile(activities=[ProfilerActivity.CPU]))
    train(engine_class, steps=2)
    report = auditor._state.report(0, 1)
    assert report["cuda_syncs"] == [{phase: 0 for phase in audit_report.PHASES}] * 2 and len(started) == 12
    assert re.search(r"^cuda( +0){10}$", audit_report.table([report]), re.M), audit_report.table([report])


def test_no_second_profiler_while_the_runs_own_is_on():
    """A second torch profiler would record nothing and stop the run's own one: the audit then counts no CUDA syncs."""
    from torch.profiler import ProfilerActivity, profile

    from deepspeed_offload_patch.audit import rank as auditor

    assert not auditor._profiler_running()
    with profile(activities=[ProfilerActivity.CPU]):
        assert auditor._profiler_running()


def fake_pipeline_module(engine_class):
    """A stand-in for ``deepspeed.runtime.pipe.engine``: a ``PipelineEngine`` subclass of the stand-in engine whose
    ``train_batch()`` runs a schedule through ``_INSTRUCTION_MAP`` as DeepSpeed's does (a forward and a backward per
    micro-batch, then ReduceGrads and OptimizerStep), with known host reads: 2 in each backward pass (one of them
    through the engine's own, counted, ``backward``), 3 in ReduceGrads, 1 in OptimizerStep, 1 outside the
    instructions; ``eval_batch()`` runs forward passes only."""
    import types

    import torch

    kinds = {name: type(name, (), {}) for name in ("ForwardPass", "BackwardPass", "ReduceGrads", "OptimizerStep")}

    class PipelineEngine(engine_class):

        def _exec_forward_pass(self):
            super().forward(torch.ones(()))

        def _exec_backward_pass(self):
            bool(torch.ones(()) > 0)
            engine_class.backward(self, torch.zeros(()))  # the stand-in reads the host once off the boundary

        def _exec_reduce_grads(self):
            for _ in range(3):
                bool(torch.ones(()) > 0)

        def _exec_optimizer_step(self):
            float(torch.ones(()).sum())
            self.global_steps += 1

        _INSTRUCTION_MAP = {
            kinds["ForwardPass"]: _exec_forward_pass,
            kinds["BackwardPass"]: _exec_backward_pass,
            kinds["ReduceGrads"]: _exec_reduce_grads,
            kinds["OptimizerStep"]: _exec_optimizer_step,
        }

        def _run(self, names):
            for name in names:
                types.MethodType(self._INSTRUCTION_MAP[kinds[name]], self)()

        def train_batch(self):
            self._run(["ForwardPass", "BackwardPass"] * 2 + ["ReduceGrads", "OptimizerStep"])
            return float(torch.ones(()).sum())  # the loss, read outside any instruction

        def eval_batch(self):
            self._run(["ForwardPass"] * 2)

        def forward(self, *args):
            raise RuntimeError("Only train_batch() is accessible in pipeline mode.")

    return types.SimpleNamespace(PipelineEngine=PipelineEngine)


def test_under_the_pipeline_engine_each_train_batch_is_one_optimizer_step(audit_state, tmp_path, capsys):
    """Each ``train_batch()`` counts as one optimizer step, its host syncs split by the instructions that made them;
    the engine's own wrappers do not count a pipeline engine (the nested ``backward``, ``eval_batch()``), and the
    results are the schedule's own."""
    auditor, engine_class = audit_state
    module = fake_pipeline_module(engine_class)
    auditor.instrument_pipeline(module)
    auditor.instrument_pipeline(module)  # idempotent: wrapped once
    engine = module.PipelineEngine()
    engine.eval_batch()
    assert auditor._state.calls == 0 and auditor._state.engine is None
    assert [engine.train_batch() for _ in range(3)] == [1.0] * 3 and engine.global_steps == 3
    expected = {"forward": 0, "backward": 4, "reduce_grads": 3, "pipe_comm": 0, "optimizer_step": 1, "other": 1}
    assert auditor._state.steps == [expected, expected] and auditor._state.done
    rank0 = json.loads((tmp_path / "rank-0.json").read_text())
    assert rank0["engine"] == "pipeline" and rank0["phases"] == list(audit_report.PIPELINE_PHASES)
    assert rank0["cuda_syncs"] is None and rank0["top"]["reduce_grads"][0]["count"] == 6, rank0["top"]
    printed = capsys.readouterr().out
    assert re.search(
        r"^ *rank +forward +backward +ReduceGrads +load, send, recv +OptimizerStep +rest of train_batch "
        r"+whole step$", printed, re.M), printed
    assert re.search(r"^ +0 +0 +0 +4 +4 +3 +3 +0 +0 +1 +1 +1 +1 +9 +9$", printed, re.M), printed
    # The backward budget covers ReduceGrads under the pipeline, and names it.
    violations = audit_report.check_budgets([rank0], {"max_backward_syncs": 3, "max_step_syncs": 0})
    assert [(v.phase, v.count) for v in violations] == [("backward", 4), ("optimizer_step", 1)], violations
    reduce_grads = audit_report.check_budgets([rank0], {"max_backward_syncs": 0})[1]
    assert str(reduce_grads).startswith("ReduceGrads: rank 0 made 3 host syncs in optimizer step 1 (budget 0)")


def test_a_train_batch_that_raises_ends_no_step_and_keeps_its_counts(audit_state):
    auditor, engine_class = audit_state
    module = fake_pipeline_module(engine_class)

    def failing(self):
        self._run(["ForwardPass", "BackwardPass", "ReduceGrads"])
        raise ValueError("StopIteration in the user's data")

    module.PipelineEngine.train_batch = failing
    auditor.instrument_pipeline(module)
    with pytest.raises(ValueError):
        module.PipelineEngine().train_batch()
    assert auditor._state.steps == [] and auditor._state.current["reduce_grads"] == 3
    assert auditor._state.current["backward"] == 2 and not getattr(auditor._state.local, "active", False)
