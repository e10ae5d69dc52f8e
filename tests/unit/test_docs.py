# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The documents a user reads first hold what the code does: every CLI option is on docs/cli.md, README.md stays
short, and its links lead somewhere."""

import os
import re
import sys

from unit.common import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_cli_option_is_documented():
    result = run_command([sys.executable, os.path.join(ROOT, "ci", "cli_docs.py"), "--check"], cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_missing_option_fails_the_docs_check(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "ci"))
    import cli_docs
    text = open(cli_docs.PAGE).read().replace("--max-backward-syncs", "--max-backward")
    assert "ds-offload-patch audit: --max-backward-syncs is not documented" in cli_docs.missing(text)


def test_readme_is_short_and_answers_first():
    text = open(os.path.join(ROOT, "README.md")).read()
    lines = text.splitlines()
    assert len(lines) <= 200, len(lines)
    first = "\n".join(lines[:40])
    for heading in ("Are you affected?", "What you gain", "Install", "Use", "Is it working?"):
        assert heading in first, heading


def test_readme_links_lead_to_files():
    for name in ("README.md", "ci/README.md", "docs/audit.md", "docs/releases.md", "docs/benchmark.md", "docs/gpu.md"):
        text = open(os.path.join(ROOT, name)).read()
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(name), target))
            assert os.path.exists(path), f"{name} links to {target}, which does not exist"


def _between(text: str, name: str) -> str:
    return text.split(f"<!-- {name}:start -->\n", 1)[1].split(f"<!-- {name}:end -->", 1)[0]


def test_the_gpu_numbers_are_the_measured_ones():
    # docs/gpu.md's table is what the benchmark wrote on the GPU (docs/gpu-check/bench.json), not a copy by hand.
    import json

    from deepspeed_offload_patch.bench import render_cuda_table

    with open(os.path.join(ROOT, "docs", "gpu-check", "bench.json")) as f:
        measured = json.load(f)["results"]
    with open(os.path.join(ROOT, "docs", "gpu.md")) as f:
        assert _between(f.read(), "gpu") == render_cuda_table(measured)
    whole = {r["n"]: r["cuda"]["whole"]["cudaStreamSynchronize"] for r in measured["patched+grad-norm"]}
    assert len(whole) > 1 and len(set(whole.values())) == 1, whole
