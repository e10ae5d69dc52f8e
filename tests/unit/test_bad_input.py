# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""What the docs promise for input a user gets wrong or a setup that is missing a piece: strict mode without
DeepSpeed, and the import-time INFO line that DeepSpeed's logger shows on some releases only. Odd switch values are
in ``test_patch_lifecycle.py`` and ``test_skipped_step.py``; every documented exit code in ``test_cli.py``."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
from packaging.version import Version

from unit.common import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The first DeepSpeed release whose logger is at WARNING (0.14.0 - 0.17.5 log at INFO).
FIRST_WARNING_LOGGER = "0.17.6"
INFO_LINE = "[deepspeed_offload_patch] the overflow flag fix: applied"
NO_DEEPSPEED = 'import sys\nsys.modules["deepspeed"] = None  # as if DeepSpeed were not installed\n'


def _python(code: str, without_deepspeed: bool = False, **env) -> subprocess.CompletedProcess:
    program = (NO_DEEPSPEED if without_deepspeed else "") + textwrap.dedent(code)
    return run_command([sys.executable, "-c", program], env=env)


def test_strict_mode_without_deepspeed_warns_on_import_and_apply_raises():
    """Strict mode guards a training process against running unpatched; without DeepSpeed there is none to guard
    (``import deepspeed`` fails on its own), so the import warns as it does without strict mode, and ``apply()``
    raises ImportError as it always does without DeepSpeed."""
    result = _python("""
        import deepspeed_offload_patch as dop
        assert dop.status().state == "deepspeed-missing", dop.status()
        try:
            dop.apply()
        except ImportError as exc:
            assert exc.name == "deepspeed", exc
        else:
            raise AssertionError("apply() without DeepSpeed did not raise")
    """,
                     without_deepspeed=True,
                     DS_OFFLOAD_PATCH_STRICT="1")
    assert result.returncode == 0, result
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "[deepspeed_offload_patch]" in line]
    assert len(lines) == 1 and "deepspeed-missing" in lines[0] and "pip install deepspeed" in lines[0], result


@pytest.mark.parametrize("command, code", [("check", 4), ("status", 4)])
def test_strict_mode_without_deepspeed_the_cli_reports_and_exits_4(command, code):
    result = _python(f"""
        from deepspeed_offload_patch.cli import main
        sys.exit(main(["{command}"]))
    """,
                     without_deepspeed=True,
                     DS_OFFLOAD_PATCH_STRICT="1")
    assert result.returncode == code and "deepspeed-missing" in result.stdout, result
    assert "Traceback" not in result.stderr, result


def test_the_import_time_info_line_shows_where_the_docs_say():
    """The applied line is logged at INFO through DeepSpeed's logger: visible on the releases whose logger is at INFO
    (before 0.17.6), not on later ones; README and docs/releases.md say so and point to ``status``."""
    from deepspeed_offload_patch.patcher import deepspeed_version

    result = _python("""
        import deepspeed_offload_patch, deepspeed
        import deepspeed.runtime.zero.stage_1_and_2
        print(deepspeed_offload_patch.status().state)
    """)
    assert result.returncode == 0 and result.stdout.strip().endswith("applied"), result
    shown = INFO_LINE in result.stdout + result.stderr
    assert shown == (Version(deepspeed_version()) < Version(FIRST_WARNING_LOGGER)), result
    for doc in ("README.md", "docs/releases.md"):
        with open(os.path.join(ROOT, doc)) as f:
            text = re.sub(r"\s+", " ", f.read())
        assert f"INFO line, which DeepSpeed shows before {FIRST_WARNING_LOGGER}" in text, doc


CLI = [sys.executable, "-m", "deepspeed_offload_patch"]


@pytest.mark.parametrize(
    "args, code",
    [
        (["run"], 2),  # no command
        (["run", "--", "/nonexistent/command"], 127),  # cannot start it
        (["run", "--", sys.executable, "-c", "import sys; sys.exit(7)"], 7),  # the command's own code
        (["audit", "--", "/nonexistent/command"], 127),
        (["affected", "/nonexistent/ds_config.json"], 2),  # unreadable config
    ])
def test_documented_exit_codes_of_run_audit_and_affected(args, code):
    result = run_command(CLI + args)
    assert result.returncode == code, result
    assert "Traceback" not in result.stderr, result


def test_an_odd_strict_value_reads_as_not_strict_where_the_patch_cannot_apply():
    """``STRICT=maybe`` warns that it reads as 0, and then does what 0 does on an unknown release: one WARNING, DeepSpeed
    untouched, no error."""
    result = _python("""
        import deepspeed_offload_patch as dop
        from deepspeed_offload_patch import patcher
        patcher.deepspeed_version = lambda: "0.13.5"
        import deepspeed
        import deepspeed.runtime.zero.stage_1_and_2
        assert dop.status().state == "unsupported", dop.status()
        assert not dop.is_applied()
    """,
                     DS_OFFLOAD_PATCH_STRICT="maybe")
    assert result.returncode == 0, result
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "[deepspeed_offload_patch]" in line]
    assert any("'maybe' is neither 0 nor 1" in line and "not strict" in line for line in lines), lines
    assert any("0.13.5" in line and "unsupported" in line for line in lines), lines


@pytest.mark.parametrize("devices, code", [(1, 2), (2, None)])
def test_bench_refuses_more_ranks_than_the_gpus_it_has(devices, code):
    """``bench --world-size 2`` on a one-GPU machine exits 2 before any rank starts and says what to pass; with a
    device per rank it goes on (the fake accelerator stops it right after, at the first rank)."""
    result = _python(f"""
        import deepspeed.accelerator
        from deepspeed_offload_patch import bench

        class OneGPU:
            def device_name(self): return "cuda"
            def device_count(self): return {devices}

        deepspeed.accelerator.get_accelerator = lambda: OneGPU()
        def started(*args, **kwargs): raise SystemExit("ranks started")
        bench.run_distributed = started
        raise SystemExit(bench.main(["--world-size", "2", "--quick"]))
        """)
    if code == 2:
        assert result.returncode == 2, result
        assert "--world-size 2 needs a device per rank; this machine's accelerator has 1: pass --world-size 1" in \
            result.stderr, result.stderr
    else:
        assert "ranks started" in result.stderr, result
