# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""``status``, ``status --json``, ``check`` and ``diff`` print, byte for byte, what ``tests/release/cli_golden``
recorded (``ci/cli_golden.py``), on one release of each form of DeepSpeed's methods run from its own sdist, the
switches' scenarios on the newest; and a changed word fails the comparison. Every release:
``python ci/cli_golden.py --check`` (``nox -s sources`` runs it).

Not in the default suite: it reads sdists (``ci/sdists.py``'s cache, fetched when missing).
"""

import os
import shutil
import sys

from unit.common import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SDISTS = os.environ.get("DS_OFFLOAD_PATCH_SDISTS", os.path.expanduser("~/.cache/ds-offload-patch/sdists"))
GOLDEN = os.path.join(ROOT, "tests", "release", "cli_golden")
#: The first release (its import fails on the current torch), one of each form (0.14.0 - 0.17.0, 0.17.x, 0.18.0 -
#: 0.19.6, 0.19.7 on), the newest last (the switches' scenarios run on it).
ONE_OF_EACH_FORM = ("0.14.0", "0.16.9", "0.17.1", "0.19.6", "0.19.8")


def golden(*args):
    result = run_command(
        [sys.executable, os.path.join(ROOT, "ci", "cli_golden.py"), "--sdists", SDISTS, *args], cwd=ROOT)
    return result.returncode, result.stdout + result.stderr


def test_the_commands_print_what_was_recorded():
    code, output = golden("--check", "--quick", *ONE_OF_EACH_FORM)
    assert code == 0, output
    assert output.count(": same") == len(ONE_OF_EACH_FORM), output


def test_a_changed_word_fails_the_comparison(tmp_path):
    record = open(os.path.join(GOLDEN, "0.19.7.txt")).read()
    assert "on-device grad norm: applied" in record
    shutil.copytree(GOLDEN, tmp_path / "golden")
    (tmp_path / "golden" / "0.19.7.txt").write_text(
        record.replace("on-device grad norm: applied", "on-device gradient norm: applied"))
    code, output = golden("--check", "--golden", str(tmp_path / "golden"), "0.19.7")
    assert code == 1 and "0.19.7: DIFFERS" in output, output
    assert "-on-device gradient norm: applied" in output and "+on-device grad norm: applied" in output, output
