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

from deepspeed_offload_patch import audit_report
from unit.common import assert_ok, run_command

CLI = [sys.executable, "-m", "deepspeed_offload_patch"]
TENSORS = 40  # ci/smoke_train.py's default: 20 Linear layers, 20 tensors in each rank's partition
DISABLE = "DS_OFFLOAD_PATCH_DISABLE"

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ci",
                      "smoke_train.py")

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user_repo")
    shutil.copy(SCRIPT, folder / "train.py")  # the user's repository: a folder with its training script
    return folder


def launched(args, script, env=None, timeout=300.0):
    """``ds-offload-patch ARGS`` in the user's folder, with this interpreter's launchers first on PATH."""
    env = dict(env or {})
    env.update({"LOCAL_SIZE": "2", "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")})
    return run_command(CLI + list(args), env=env, cwd=script, timeout=timeout)


TORCHRUN = ["torchrun", "--nproc_per_node", "2", "train.py"]


def column(report, phase):
    return [step[phase] for step in report["steps"]]


@pytest.mark.equivalence
def test_compare_under_the_deepspeed_launcher(script):
    """The issue's case: N/2 host syncs per rank in the boundary backward unpatched, 0 patched, at N tensors."""
    path = script / "compare.json"
    result = launched([
        "audit", "--compare", "--steps", "2", "--stop-after", "--max-backward-syncs", "--json",
        str(path), "--", "deepspeed", "--num_gpus", "2", "train.py"
    ], script)
    output = assert_ok(result)
    runs = json.loads(path.read_text())["runs"]
    for name, state, boundary in (("unpatched", "disabled", TENSORS // 2), ("patched", "applied", 0)):
        ranks = runs[name]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and runs[name]["exit_code"] == 0, runs[name]
        for report in ranks:
            assert report["patch_state"] == state and report["complete"], report
            assert column(report, "boundary_backward") == [boundary, boundary], (name, report)
            assert column(report, "other_backward") == [0, 0], (name, report)
            assert len(column(report, "step")) == 2 and len(column(report, "forward")) == 2
        if boundary:
            first = ranks[0]["top"]["boundary_backward"][0]
            assert "stage_1_and_2.py:" in first["line"] and first["count"] == 2 * boundary, first
    # Printed side by side, as ci/demo.sh prints its runs; --stop-after ended every rank after the counted steps.
    assert re.search(rf"^unpatched +0 +0 +0 +{TENSORS // 2} +{TENSORS // 2} +0 +0 ", output, re.M), output
    assert re.search(r"^patched +1 +0 +0 +0 +0 +0 +0 ", output, re.M), output
    assert output.count("stopping after 2 counted steps") == 4 and " done: " not in output, output
    assert "audit: OK: every rank within --max-backward-syncs 0" in output


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
    audited = launched(
        ["audit", "--steps", "2", "--max-backward-syncs", "--", *common, "--save",
         str(tmp_path / "audited")],
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
    assert "audit: OK: every rank within --max-backward-syncs 0" in output


def test_a_command_without_a_deepspeed_step_fails_the_audit(tmp_path):
    result = run_command(CLI + ["audit", "--", sys.executable, "-c", "import deepspeed; print('imported')"],
                         cwd=tmp_path)
    assert result.returncode == 1 and "imported" in result.stdout, result
    assert "exited with code" not in result.stdout and "counted no DeepSpeed optimizer step" in result.stdout, result


def test_a_failing_command_keeps_its_exit_code(tmp_path):
    result = run_command(CLI + ["audit", "--", sys.executable, "-c", "raise SystemExit(3)"], cwd=tmp_path)
    assert result.returncode == 3 and "the command exited with code 3" in result.stdout, result


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


def test_the_ci_template_audit_command_parses():
    """The command in ci/templates/ds-offload-patch.yml is one this version accepts, with the budgets it says."""
    import shlex

    from deepspeed_offload_patch import cli

    template = os.path.join(os.path.dirname(os.path.dirname(SCRIPT)), "ci", "templates", "ds-offload-patch.yml")
    text = open(template).read().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.strip().startswith("ds-offload-patch audit"))
    args = cli.build_parser().parse_args(shlex.split(line)[1:])
    assert args.cmd == "audit" and args.stop_after and args.json and args.command[0] == "--", args
    assert (args.steps, args.max_backward_syncs, args.max_step_syncs) == (2, 0, 64)
