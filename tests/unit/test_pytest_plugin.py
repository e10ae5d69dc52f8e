# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The pytest plugin patches only when asked: a plain pytest run in an unrelated project, where the package is
installed, leaves DeepSpeed's methods alone; ``--ds-offload-patch`` or ``ds_offload_patch = true`` in the ini file
patches them; the host-sync fixtures work in every case."""

import json
import sys
import textwrap

import pytest

from unit.common import run_command

PROJECT_TEST = """
import json
import os

import torch


def test_fixtures_and_state(host_sync_counter, no_host_sync):
    with host_sync_counter() as syncs:
        torch.tensor([1.0]).item()
    assert syncs.total == 1, syncs.counts
    with no_host_sync():
        torch.ones(2) + 1

    from deepspeed.runtime.zero import stage_1_and_2
    import deepspeed_offload_patch as dop
    cls = stage_1_and_2.DeepSpeedZeroOptimizer
    origins = sorted({getattr(cls.__dict__[name], "__module__", "?") for name in ("has_overflow", )})
    with open(os.environ["PLUGIN_REPORT"], "w") as f:
        json.dump({"state": dop.status().state, "origins": origins}, f)
"""


def _run(tmp_path, *args, ini: str = "") -> dict:
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_project.py").write_text(textwrap.dedent(PROJECT_TEST))
    (project / "pytest.ini").write_text("[pytest]\n" + ini)
    report = tmp_path / "report.json"
    result = run_command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                         env={"PLUGIN_REPORT": str(report)},
                         cwd=project)
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout + result.stderr
    return json.loads(report.read_text())


def test_a_plain_run_leaves_deepspeed_unpatched(tmp_path):
    found = _run(tmp_path)
    assert found["state"] == "not-applied", found
    assert found["origins"] == ["deepspeed.runtime.zero.stage_1_and_2"], found


@pytest.mark.parametrize("how", ["option", "ini"])
def test_asking_patches(tmp_path, how):
    if how == "option":
        found = _run(tmp_path, "--ds-offload-patch")
    else:
        found = _run(tmp_path, ini="ds_offload_patch = true\n")
    assert found["state"] == "applied", found
    assert found["origins"] == ["deepspeed_offload_patch.changes.overflow_flag.methods"], found
