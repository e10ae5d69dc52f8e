# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The reproducer of ``docs/upstream/`` prints what its report shows, on DeepSpeed 0.19.8 (about 20 s on 2 cores; not
in the default suite or CI: ``pytest tests/release/test_upstream_report.py``)."""

import os
import re
import sys

from unit.common import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UPSTREAM = os.path.join(ROOT, "docs", "upstream")


def test_the_reproducer_prints_what_the_report_shows():
    result = run_command([sys.executable, "repro_skipped_step.py", "--stage", "2", "--precision", "bf16"],
                         cwd=UPSTREAM)
    assert result.returncode == 0, result.stdout + result.stderr
    printed = [line for line in result.stdout.splitlines() if line.startswith(("DeepSpeed", "as released", "with"))]
    report = open(os.path.join(UPSTREAM, "skipped-step.md")).read()
    shown = re.search(r"\$ python repro_skipped_step.py[^\n]*\n(.*?)\n\(DeepSpeed", report, re.S).group(1)
    assert printed == shown.splitlines(), printed
