# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The CI template's own commands, read from ``ci/templates/ds-offload-patch.yml`` and run as a training repository
runs them: its gate job on the installed DeepSpeed, its audit job on a plain smoke script (``ci/smoke_train.py`` as
the repository's ``train.py``, with the template's ``ds_config_smoke.json``) at 40 and at 500 parameter tensors. A
template that drifts from the CLI, or budgets that depend on the model's size, fail here."""

import json
import os
import re
import shlex
import shutil
import sys

import pytest

from unit.common import on_free_port, run_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATES = os.path.join(ROOT, "ci", "templates")
TEMPLATE = os.path.join(TEMPLATES, "ds-offload-patch.yml")
BIN = os.path.dirname(sys.executable)

pytestmark = pytest.mark.filterwarnings("ignore")


def template_commands():
    """Every ``ds-offload-patch`` command of the template, as argument lists, and the environment it sets."""
    text = open(TEMPLATE).read().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        line = line.strip()
        line = line[len("run: "):] if line.startswith("run: ") else line
        if line.startswith("ds-offload-patch "):
            commands.append(shlex.split(line))
    env = dict(re.findall(r"^\s+([A-Z_]+): \"([^\"]*)\"", text, re.M))
    return commands, env


def command(name):
    commands, env = template_commands()
    found = [c for c in commands if c[1] == name]
    assert len(found) == 1, commands
    return found[0], env


def run_template(args, cwd, env=None):
    env = dict(env or {})
    env["PATH"] = BIN + os.pathsep + os.environ.get("PATH", "")  # this interpreter's ds-offload-patch and deepspeed
    return run_command(args, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A training repository as the template expects it: train.py and ds_config_smoke.json."""
    folder = tmp_path_factory.mktemp("training_repo")
    shutil.copy(os.path.join(ROOT, "ci", "smoke_train.py"), folder / "train.py")
    shutil.copy(os.path.join(TEMPLATES, "ds_config_smoke.json"), folder / "ds_config_smoke.json")
    return folder


@pytest.mark.parametrize("name", ["check", "verify"])
def test_the_gate_job_passes_on_the_installed_deepspeed(name, repo):
    args, _ = command(name)
    result = run_template(args, repo)
    assert result.returncode == 0, result


@pytest.mark.equivalence
@pytest.mark.parametrize("layers, disabled", [(20, False), (250, False), (250, True)])
def test_the_audit_job_passes_patched_and_fails_unpatched_whatever_the_size(layers, disabled, repo, tmp_path):
    """Budgets that do not depend on the model: 40 and 500 tensors pass patched, the whole step included; 500 fail
    with the patch disabled, naming the boundary backward and DeepSpeed's line, and the whole step."""
    args, env = command("audit")
    assert "--max-total-syncs" in args, args  # with the defaults, a whole step's count does not grow with the model
    report = tmp_path / "audit.json"
    args = [report if arg == "ds-offload-patch-audit.json" else arg for arg in args] + ["--layers", str(layers)]
    if disabled:
        env["DS_OFFLOAD_PATCH_DISABLE"] = "1"
    result = run_template(on_free_port([str(arg) for arg in args]), repo, env=env)
    output = result.stdout + result.stderr
    ranks = json.loads(report.read_text())["runs"]["run"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1], ranks
    tensors = 2 * layers
    if disabled:
        assert result.returncode == 1, output
        for rank in (0, 1):
            assert re.search(
                rf"FAIL: boundary backward: rank {rank} made {tensors // 2} host syncs in optimizer step \d "
                rf"\(budget 0\); top lines: +\d+ +deepspeed/runtime/zero/stage_1_and_2\.py:\d+ ", output), output
            assert re.search(rf"FAIL: whole step: rank {rank} made \d+ host syncs in optimizer step \d \(budget 10\)",
                             output), output
    else:
        assert result.returncode == 0, output
        for r in ranks:
            assert r["patch_state"] == "applied" and r["complete"], r
            assert [step["boundary_backward"] for step in r["steps"]] == [0, 0], r
            assert all(sum(step.values()) <= 10 for step in r["steps"]), r


def test_the_upstream_watch_passes_on_the_newest_release(tmp_path):
    """The watch workflow's own command on the DeepSpeed installed here (the newest release this machine reaches). The
    builds it must fail on (a tracker that still reads the host) run in the matrix's variant sessions."""
    sys.path.insert(0, os.path.join(ROOT, "ci"))
    from upstream_watch import TEMPLATE, template_command

    text = open(os.path.join(ROOT, TEMPLATE)).read()
    for source in ("pip install --upgrade deepspeed", "pip install --upgrade --pre deepspeed",
                   "git+https://github.com/deepspeedai/DeepSpeed.git", "schedule:", "gh issue create"):
        assert source in text, source
    command = template_command(os.path.join(ROOT, TEMPLATE))
    report = tmp_path / "watch.md"
    command = [sys.executable if arg == "python" else str(report) if arg == "watch.md" else arg for arg in command]
    result = run_template(command, ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "upstream watch: OK: DeepSpeed" in result.stdout and "verify passes" in result.stdout, result.stdout
    assert report.read_text().startswith("upstream watch: OK"), report.read_text()


def test_the_upstream_watch_fails_when_one_inf_is_not_skipped(monkeypatch, capsys):
    """A release on which a cell of the watch's one-inf row comes out otherwise (NaN weights here) fails the watch,
    and its line names the cell and the outcome, though the state and verify are good."""
    sys.path.insert(0, os.path.join(ROOT, "ci"))
    import upstream_watch

    from deepspeed_offload_patch.changes import OTHERS

    found = {"deepspeed_version": "0.20.0", "state": "applied", "reason": "", "methods": {}}
    found.update({change.state_key: change.good_states[0] for change in OTHERS})
    row = dict.fromkeys(upstream_watch.ROW, "skipped: skipped steps 1")
    row["s3-fp32-ga1-inf-one"] = "nan-weights: non-finite parameters after step 1, skipped steps 0"
    monkeypatch.setattr(upstream_watch, "status", lambda: found)
    monkeypatch.setattr(upstream_watch, "verify", lambda: (0, "verify: ok"))
    monkeypatch.setattr(upstream_watch, "one_inf_row", lambda: row)
    monkeypatch.setattr(sys, "argv", ["upstream_watch.py"])
    assert upstream_watch.main() == 1
    line = capsys.readouterr().out.strip()
    assert line.startswith("upstream watch: FAIL: DeepSpeed 0.20.0: one inf is not skipped: s3-fp32-ga1-inf-one: "
                           "nan-weights"), line


def test_the_gate_runs_on_the_python_the_repository_trains_with():
    """One variable, documented at the top, sets the Python of every job: a gate that ran on another interpreter than
    the training could pass while the training runs unpatched."""
    sys.path.insert(0, os.path.join(ROOT, "ci"))
    from pythons import SUPPORTED
    text = open(TEMPLATE).read()
    versions = re.findall(r"python-version: (.*)", text)
    assert versions and all(v.strip() == "${{ env.PYTHON_VERSION }}" for v in versions), versions
    value = re.search(r"^env:\n  PYTHON_VERSION: \"([0-9.]+)\"", text, re.M)
    assert value and value.group(1) in SUPPORTED, "PYTHON_VERSION is set once, at the top, to a supported Python"
    assert "PYTHON_VERSION below" in text.split("\nname:")[0], "the header says what to change"
    # The upstream watch runs on the newest Python of the runner image, to meet a new interpreter before users do.
    watch = open(os.path.join(TEMPLATES, "upstream-watch.yml")).read()
    assert re.findall(r"python-version: \"([^\"]+)\"", watch) == ["3.x"]
