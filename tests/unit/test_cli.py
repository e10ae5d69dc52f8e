# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""``ds-offload-patch``: the status, the CI gate (also against an altered and a diff-patched DeepSpeed), the
behavioural check, the diff, the launcher, and the pytest fixtures used from another repository."""

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from deepspeed_offload_patch import diffs
from unit.common import assert_ok, on_free_port, run_command

CLI = [sys.executable, "-m", "deepspeed_offload_patch"]
TARGET = os.path.join("deepspeed", "runtime", "zero", "stage_1_and_2.py")


def cli(*args, **kwargs) -> subprocess.CompletedProcess:
    return run_command(CLI + list(args), **kwargs)


@pytest.fixture(scope="module")
def deepspeed_dir():
    import importlib.util
    return os.path.dirname(importlib.util.find_spec("deepspeed").origin)


def deepspeed_copy(tmp_path, deepspeed_dir, change) -> dict:
    """A copy of the installed DeepSpeed in a site folder of its own, changed by ``change(path of the target
    file)``; returns the environment that puts it first on the path."""
    site = tmp_path / "site"
    shutil.copytree(deepspeed_dir, site / "deepspeed", ignore=shutil.ignore_patterns("__pycache__"))
    change(site / TARGET)
    return {"PYTHONPATH": os.pathsep.join([str(site)] + [p for p in sys.path if p])}


def test_diff_on_a_newer_build_is_the_diff_of_its_form(tmp_path, deepspeed_dir):
    """DeepSpeed built as 0.19.9 with 0.19.8's code: ``diff`` gives the diff of the last release with those methods,
    which applies to it."""

    def newer(target):
        path = target.parents[2] / "git_version_info_installed.py"
        path.write_text(re.sub(r"version='[^']*'", "version='0.19.9'", path.read_text()))

    env = deepspeed_copy(tmp_path, deepspeed_dir, newer)
    import deepspeed
    expected = diffs.diff_for(deepspeed.__version__)
    result = cli("diff", env=env)
    assert_ok(result)
    assert result.stdout == expected[1] and expected[0] in result.stderr, result.stderr
    status = json.loads(cli("status", "--json", env=env).stdout)
    assert status["deepspeed_version"] == "0.19.9" and status["state"] == "applied", status


def test_status_json_is_stable():
    result = cli("status", "--json")
    assert_ok(result)
    status = json.loads(result.stdout)
    assert set(status) == {
        "package_version", "python", "deepspeed_version", "state", "reason", "methods", "grad_norm_on_device",
        "grad_norm_reason", "skipped_step", "skipped_step_reason", "grad_accumulation", "grad_accumulation_reason",
        "several_backwards", "several_backwards_reason", "invalid_norm", "invalid_norm_reason", "rank_agreement",
        "rank_agreement_reason", "bf16_check", "bf16_check_reason", "zero3_overflow", "zero3_overflow_reason",
        "event_waits", "event_waits_reason"
    }
    assert status["state"] == "applied", status
    fix = {"update_offload_overflow_tracker": "patchable", "has_overflow": "patchable"}
    skipped_step = {
        "reset_cpu_buffers": "patchable",
        "step": "patchable"
    } if status["skipped_step"] == "applied" else {}
    grad_norm = {"complete_grad_norm_calculation_for_cpu_offload": "patchable"}
    assert status["grad_norm_on_device"] == "applied", status
    # The accumulation fixes' methods: a known defective form where they apply, else code that behaves right.
    accumulation = {
        method: "patchable" if status[key] == "applied" else "fixed"
        for method, key in (("async_accumulate_grad_in_cpu_via_gpu", "grad_accumulation"),
                            ("copy_grads_in_partition", "several_backwards"), ("scaled_global_norm", "invalid_norm"))
    }
    # _update_scale and _check_overflow are DeepSpeed's own text on every release: a known form, whichever way their
    # fixes go.
    invalid_norm = {"_update_scale": "patchable", "_check_overflow": "patchable"}
    # Another class's methods by Class.name: ZeRO-3's, in a known defective form where its fix applies.
    zero3 = {
        "DeepSpeedZeroOptimizer_Stage3._overflow_check_and_loss_scale_update":
        "patchable" if status["zero3_overflow"] == "applied" else "fixed"
    }
    assert status["methods"] == {**fix, **skipped_step, **grad_norm, **accumulation, **invalid_norm, **zero3}, status


def test_status_is_readable():
    output = assert_ok(cli("status"))
    assert "applied" in output and "DeepSpeedZeroOptimizer.has_overflow: patchable" in output, output


def test_check_passes_on_the_installed_release():
    script = os.path.join(os.path.dirname(sys.executable), "ds-offload-patch")
    result = run_command([script, "check"])
    assert result.returncode == 0 and "OK" in result.stdout, result
    # The interpreter it ran on: the same DeepSpeed can be patched on one Python and not on another.
    assert f"(Python {platform.python_version()})" in result.stdout, result


@pytest.mark.parametrize("env, code, word", [({
    "DS_OFFLOAD_PATCH_DISABLE": "1"
}, 5, "disabled"), ({
    "DS_OFFLOAD_PATCH_AUTO": "0"
}, 1, "not-applied")])
def test_check_fails_when_disabled(env, code, word):
    result = cli("check", env=env)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == code and len(lines) == 1 and word in lines[0], result
    assert f"Python {platform.python_version()}" in lines[0], result


# A child that sets the scene, then runs the CLI in the same process and exits with its code.
SCENES = {
    # Another patch replaced the tracker before this package saw DeepSpeed's ZeRO module.
    "conflict": """
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
        def other_patch(self, grad):
            pass
        DeepSpeedZeroOptimizer.update_offload_overflow_tracker = other_patch
    """,
    # DeepSpeed cannot be imported, as if it were not installed.
    "deepspeed-missing": """
        sys.modules["deepspeed"] = None
    """,
}


@pytest.mark.parametrize("command", ["check", "status"])
@pytest.mark.parametrize("state, code", [("conflict", 3), ("deepspeed-missing", 4)])
def test_exit_codes_of_conflict_and_missing_deepspeed(state, code, command):
    program = "import sys\n" + textwrap.dedent(SCENES[state]) + textwrap.dedent("""
        from deepspeed_offload_patch.cli import main
        sys.exit(main([sys.argv[1]]))
    """)
    result = run_command([sys.executable, "-c", program, command])
    assert result.returncode == code and state in result.stdout, result


def test_check_fails_on_an_altered_deepspeed(tmp_path, deepspeed_dir):

    def alter(path):
        text = path.read_text()
        text = text.replace("            self.local_overflow = True\n",
                            "            self.local_overflow = True\n            self.overflow_seen = True\n", 1)
        path.write_text(text)

    result = cli("check", env=deepspeed_copy(tmp_path, deepspeed_dir, alter))
    assert result.returncode == 1, result
    assert "unsupported" in result.stdout and "update_offload_overflow_tracker: mismatch" in result.stdout, result


def test_diff_applies_to_the_installed_file_and_is_seen_as_fixed(tmp_path, deepspeed_dir):
    result = cli("diff")
    assert_ok(result)
    assert result.stdout.startswith(f"--- a/{TARGET}"), result.stdout[:200]
    diff = tmp_path / "change.diff"
    diff.write_text(result.stdout)

    def apply_diff(path):
        subprocess.run(["patch", "-p1", "--quiet", "-i", str(diff)], cwd=tmp_path / "site", check=True)

    env = deepspeed_copy(tmp_path, deepspeed_dir, apply_diff)
    result = cli("check", env=env)
    assert result.returncode == 0 and "upstream-fixed" in result.stdout, result


def test_verify_passes_with_the_patch_and_fails_without():
    assert_ok(cli("verify"))
    result = cli("verify", env={"DS_OFFLOAD_PATCH_DISABLE": "1"})
    assert result.returncode == 1 and "synchronized with the host" in result.stdout, result


RANK_SCRIPT = """
import sys
import deepspeed
import deepspeed.ops
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
deepspeed.init_distributed(dist_backend="gloo")
patch = sys.modules.get("deepspeed_offload_patch")
print(f"rank {deepspeed.comm.get_rank()}: {patch.status().state if patch else 'not loaded'}", flush=True)
# No rank leaves before every rank has joined: on a loaded machine a rank that left while its peer was still in
# gloo's connectFullMesh failed the peer's init ("Connection closed by peer").
deepspeed.comm.barrier()
deepspeed.comm.destroy_process_group()
"""


@pytest.mark.parametrize("launcher", [["deepspeed", "--num_gpus", "2"], ["torchrun", "--nproc_per_node", "2"]])
def test_run_patches_every_rank_of_an_unmodified_script(tmp_path, launcher):
    (tmp_path / "script.py").write_text(RANK_SCRIPT)
    user_site = tmp_path / "user_site"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    (tmp_path / "check_user.py").write_text("import os\nprint('user sitecustomize', os.environ.get("
                                            "'USER_SITECUSTOMIZE'))\n")
    bindir = os.path.dirname(sys.executable)
    env = {"LOCAL_SIZE": "2", "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), "PYTHONPATH": str(user_site)}
    result = cli("run", "--", *on_free_port([*launcher, "script.py"]), env=env, cwd=tmp_path)
    output = assert_ok(result)
    assert "rank 0: applied" in output and "rank 1: applied" in output, output

    result = cli("run", "--", sys.executable, "check_user.py", env=env, cwd=tmp_path)
    assert "user sitecustomize ran" in assert_ok(result)


def test_run_without_the_launcher_leaves_the_script_unpatched(tmp_path):
    (tmp_path / "script.py").write_text(RANK_SCRIPT)
    env = {"LOCAL_SIZE": "2", "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    result = run_command(on_free_port(["torchrun", "--nproc_per_node", "2", "script.py"]), env=env, cwd=tmp_path)
    assert "rank 0: not loaded" in assert_ok(result)


def test_pytest_fixtures_from_another_repository(tmp_path):
    (tmp_path / "test_downstream.py").write_text(
        textwrap.dedent("""
        import torch

        def test_device_flag_stays_on_device(no_host_sync):
            flag = torch.zeros((), dtype=torch.bool)
            with no_host_sync():
                flag = flag | torch.isinf(torch.tensor([1.0, float("inf")])).any()

        def test_if_on_a_tensor_is_caught(no_host_sync):
            with no_host_sync():
                if torch.tensor(1.0) > 0:
                    pass

        def test_counter(host_sync_counter):
            with host_sync_counter() as syncs:
                torch.tensor([1.0, 2.0]).sum().item()
                torch.tensor([3]).tolist()
            assert syncs.counts == {"aten._local_scalar_dense": 1, "Tensor.tolist": 1}, syncs.counts
    """))
    result = run_command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_downstream.py"],
                         cwd=tmp_path)
    assert "1 failed, 2 passed" in result.stdout, result.stdout
    assert "HostSyncError: host synchronization: aten._local_scalar_dense at" in result.stdout
    assert "test_downstream.py:11 (if torch.tensor(1.0) > 0:)" in result.stdout, result.stdout


def test_grad_norm_diff_is_seen_as_fixed(tmp_path, deepspeed_dir):
    result = cli("diff", "--grad-norm")
    assert_ok(result)
    diff = tmp_path / "grad-norm.diff"
    diff.write_text(result.stdout)

    def apply_diff(path):
        subprocess.run(["patch", "-p1", "--quiet", "-i", str(diff)], cwd=tmp_path / "site", check=True)

    env = deepspeed_copy(tmp_path, deepspeed_dir, apply_diff)
    env["DS_OFFLOAD_PATCH_GRAD_NORM"] = "1"
    result = cli("status", "--json", env=env)
    assert_ok(result)
    status = json.loads(result.stdout)
    assert status["state"] == "applied" and status["grad_norm_on_device"] == "upstream-fixed", status


def test_the_gate_fails_on_a_default_change_that_cannot_apply():
    """``check``'s exit code covers every change that is on: the grad norm and the skipped-step fix too."""
    from deepspeed_offload_patch.cli import status_exit_code
    from deepspeed_offload_patch.patcher import PatchStatus

    def status(grad_norm="applied", skipped_step="applied"):
        return PatchStatus("applied", "0.19.8", "", {}, {
            "grad-norm": (grad_norm, ""),
            "skipped-step": (skipped_step, "")
        })

    assert status_exit_code(status()) == 0
    assert status_exit_code(status(grad_norm="off")) == 0  # switched off by its user
    assert status_exit_code(status(grad_norm="unsupported")) == 1
    assert status_exit_code(status(grad_norm="conflict")) == 3
    assert status_exit_code(status(skipped_step="unsupported")) == 1
