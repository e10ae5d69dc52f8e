# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""``ci/gpu-check.sh`` parses, says what it would run, and, on a machine without a CUDA GPU, refuses cleanly (exit 3,
one line, nothing run). On a GPU machine this test checks only the first two: the script itself is the check."""

import os
import subprocess

import torch

from unit.common import run_command

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ci",
                      "gpu-check.sh")


def test_the_script_parses_and_names_its_checks():
    subprocess.run(["bash", "-n", SCRIPT], check=True)
    result = run_command(["bash", SCRIPT, "--dry-run"])
    assert result.returncode == 0, result.stdout + result.stderr
    for part in ("verify", "--sizes 50 398", "whole step", "counter", "test_offload_one_rank.py", "grad norm"):
        assert part in result.stdout, result.stdout


def test_without_a_gpu_it_refuses_cleanly():
    if torch.cuda.is_available():
        return  # a GPU machine: ci/gpu-check.sh runs for real there
    result = run_command(["bash", SCRIPT])
    assert result.returncode == 3, result.stdout + result.stderr
    assert result.stdout.strip().splitlines() == [
        "gpu-check: refused: no CUDA GPU here (torch.cuda.is_available() is False); nothing was checked"
    ], result.stdout
