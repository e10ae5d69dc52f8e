# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The guard's fingerprints and ``patches/`` agree with the releases' own sources (the sdists of every supported
release, in ``ci/sdists.py``'s cache: ``$DS_OFFLOAD_PATCH_SDISTS``, default ``~/.cache/ds-offload-patch/sdists``), and
the checks catch a disagreement.

Not in the default suite: it reads 47 sdists. ``nox -f ci/noxfile.py -s sources`` fetches them first (its own step,
with progress) and runs it; the scripts here only fetch what the cache lacks.
"""

import os
import shutil
import sys

import pytest

from unit.common import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SDISTS = os.environ.get("DS_OFFLOAD_PATCH_SDISTS", os.path.expanduser("~/.cache/ds-offload-patch/sdists"))


def script(name, *args):
    result = run_command([sys.executable, os.path.join(ROOT, "ci", name), "--sdists", SDISTS, *args], cwd=ROOT)
    return result.returncode, result.stdout + result.stderr


def test_recorded_fingerprints_are_the_sources():
    code, output = script("gen_fingerprints.py", "--check")
    assert code == 0, output


def test_a_wrong_fingerprint_table_fails_the_check(tmp_path):
    table = tmp_path / "fingerprints.py"
    text = open(os.path.join(ROOT, "deepspeed_offload_patch", "fingerprints.py")).read()
    table.write_text(text.replace("'0.19.8'", "'0.19.9'"))
    code, output = script("gen_fingerprints.py", "--check", "--table", str(table))
    assert code == 1 and "differs" in output, output


def test_patches_apply_to_their_releases_and_equal_the_monkey_patch():
    code, output = script("make_patches.py", "--check")
    assert code == 0, output


@pytest.mark.parametrize("tamper", ["context", "change"])
def test_a_wrong_diff_fails_the_check(tmp_path, tamper):
    patches = tmp_path / "patches"
    shutil.copytree(os.path.join(ROOT, "patches"), patches)
    diff = next(patches.glob("overflow-flag/*0.19.7*.diff"))
    text = diff.read_text()
    if tamper == "context":
        text = text.replace(" \n", "  \n", 1)  # a context line that is not in the release's file
    else:
        text = text.replace("+        if grad is None or", "+        if grad is None and", 1)
    diff.write_text(text)
    code, output = script("make_patches.py", "--check", "--patches", str(patches))
    assert code == 1 and diff.name in output, output


def test_a_patched_method_that_reads_a_name_its_module_lacks_is_caught():
    """The check behind "the diffed file runs": names a method reads must be its own, the module's or builtins."""
    sys.path.insert(0, os.path.join(ROOT, "ci"))
    from make_patches import unresolved_globals
    source = (
        "import torch\nfrom x import y as z\nLIMIT = 1\n\n\nclass DeepSpeedZeroOptimizer:\n\n"
        "    def has_overflow(self, grads):\n        for g in grads:\n            total = torch.zeros(1) + z(g)\n"
        "        return bool(total > LIMIT) or on_device(total) or len([])\n")
    assert unresolved_globals(source, ["has_overflow"]) == {"has_overflow": ["on_device"]}
    assert unresolved_globals(source.replace("on_device(total)", "total"), ["has_overflow"]) == {}


def test_the_upstream_report_s_diff_applies_to_0_19_8_and_is_the_package_s_change(tmp_path):
    """``docs/upstream/skipped-step.md``, written for DeepSpeed's maintainers, carries the skipped-step fix's diff
    without the package's comment line: it applies to 0.19.8's file and adds the same lines otherwise."""
    import re
    import subprocess
    import tarfile
    sys.path.insert(0, os.path.join(ROOT, "ci"))
    from sdists import sdist_path
    text = open(os.path.join(ROOT, "docs", "upstream", "skipped-step.md")).read()
    diff = re.search(r"```diff\n(.*?)```", text, re.S).group(1)
    target = tmp_path / "deepspeed" / "runtime" / "zero" / "stage_1_and_2.py"
    target.parent.mkdir(parents=True)
    with tarfile.open(sdist_path(SDISTS, "0.19.8")) as tar:
        target.write_bytes(tar.extractfile("deepspeed-0.19.8/deepspeed/runtime/zero/stage_1_and_2.py").read())
    (tmp_path / "change.diff").write_text(diff)
    done = subprocess.run(["git", "apply", "change.diff"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    shipped = open(os.path.join(ROOT, "patches", "skipped-step", "stage_1_and_2-0.19.8.diff")).read()
    added = [line for line in shipped.splitlines() if line.startswith("+ ") and "# DeepSpeed's own reset" not in line]
    assert added == [line for line in diff.splitlines() if line.startswith("+ ")]
