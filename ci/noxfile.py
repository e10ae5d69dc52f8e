# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The DeepSpeed version matrix: one reused virtualenv per release, torch 2.13.0 CPU.

    nox -f ci/noxfile.py                          # CI's representative set (the default sessions)
    nox -f ci/noxfile.py -s matrix                # every supported release, and the unsupported one
    nox -f ci/noxfile.py -s "release(deepspeed='0.18.4')"
    nox -f ci/noxfile.py -s sources               # fingerprints and patches/ against the releases' sdists
    python ci/matrix_table.py [--readme]          # the table of the last results (reports/matrix/)

For a supported release, ``release`` checks that the import patches it (``status`` is ``applied``) and runs the test
suite: all of ``tests/unit``, or with the session argument ``core`` (``matrix`` passes it) the ZeRO regression tests
plus ``ds-offload-patch check`` and ``verify`` (the rest of the suite tests the package's own mechanics, the same on
every release; the representative releases run it). Then it applies the release's diffs from ``patches/``
(the fix and the opt-in grad norm) to the installed DeepSpeed: the package must report both as ``upstream-fixed``,
and with the monkey-patch disabled the ZeRO regression tests (but the equivalence tests, which would compare the
diffs with themselves) must pass on the diffs alone. The file is restored
after. For an unsupported release it runs ``tests/release/test_unsupported_release.py``. Each session writes
``reports/matrix/<release>.json``.
"""

import json
import os
import shutil
import sys
import xml.etree.ElementTree as ET

import nox

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from deepspeed_offload_patch.releases import PATCHED_RELEASES  # noqa: E402

UNSUPPORTED = ("0.16.9", )
# The first supported release, the last one whose _has_inf_or_nan returns fp32, the first bool one, the latest.
REPRESENTATIVE = ("0.17.1", "0.19.6", "0.19.7", "0.19.8")
REPORTS = os.path.join(ROOT, "reports", "matrix")
TARGET = os.path.join("deepspeed", "runtime", "zero", "stage_1_and_2.py")

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = [f"release(deepspeed='{v}')" for v in REPRESENTATIVE + UNSUPPORTED]
nox.options.envdir = os.path.join(ROOT, ".nox")


def _install(session: nox.Session, version: str) -> None:
    session.install("torch==2.13.0")  # first: a bare DeepSpeed install would pull a CUDA build of torch
    session.install(f"deepspeed=={version}", "pytest", "packaging")
    session.install("--no-deps", "--force-reinstall", ROOT)


def _junit_counts(path: str) -> dict:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    if not os.path.exists(path):
        return {"passed": 0, "failed": 1, "skipped": 0}
    for case in ET.parse(path).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def _pytest(session: nox.Session, name: str, *args, env=None) -> dict:
    xml = os.path.join(REPORTS, f"{name}.xml")
    session.run("python",
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                f"--junitxml={xml}",
                *args,
                env=env,
                success_codes=[0, 1])
    return _junit_counts(xml)


def _status(session: nox.Session, env=None) -> dict:
    out = session.run("python",
                      "-m",
                      "deepspeed_offload_patch",
                      "status",
                      "--json",
                      silent=True,
                      env=env,
                      success_codes=list(range(8)))
    return json.loads(out[out.index("{"):])


def _site_packages(session: nox.Session) -> str:
    out = session.run("python",
                      "-c",
                      "import os, deepspeed; print(os.path.dirname(os.path.dirname(deepspeed.__file__)))",
                      silent=True)
    return out.strip().splitlines()[-1]


@nox.session
@nox.parametrize("deepspeed", list(PATCHED_RELEASES) + list(UNSUPPORTED))
def release(session: nox.Session, deepspeed: str) -> None:
    """Test the package against one DeepSpeed release."""
    os.makedirs(REPORTS, exist_ok=True)
    _install(session, deepspeed)
    session.chdir(ROOT)
    clean = {"DS_OFFLOAD_PATCH_DISABLE": "0", "DS_OFFLOAD_PATCH_STRICT": "0"}
    result = {"release": deepspeed, "state": _status(session, env=clean)["state"]}
    if deepspeed in UNSUPPORTED:
        result["expected"] = "unsupported"
        result["tests"] = _pytest(session, deepspeed, "tests/release/test_unsupported_release.py", env=clean)
    else:
        result["expected"] = "applied"
        if "core" in session.posargs:
            suite = ["tests/unit/v1/zero"]
            session.run("python", "-m", "deepspeed_offload_patch", "check", env=clean)
            session.run("python", "-m", "deepspeed_offload_patch", "verify", env=clean)
        else:
            suite = ["tests/unit"]
        result["suite"] = " ".join(suite)
        result["tests"] = _pytest(session, deepspeed, *suite, env=clean)
        result.update(_with_diff(session, deepspeed))
    result["commit"] = _commit()
    with open(os.path.join(REPORTS, f"{deepspeed}.json"), "w") as f:
        json.dump(result, f, indent=2)
    session.log(json.dumps(result))
    if not _ok(result):
        session.error(f"DeepSpeed {deepspeed}: {result}")


def _with_diff(session: nox.Session, deepspeed: str) -> dict:
    """Apply the release's diffs (the fix and the opt-in grad norm) to the installed file; then, with the
    monkey-patch disabled, both must read as upstream-fixed and the ZeRO tests must pass on the diffs alone."""
    site = _site_packages(session)
    path = os.path.join(site, TARGET)
    backup = os.path.join(REPORTS, f"{deepspeed}-stage_1_and_2.py.original")  # not where patch writes its .orig
    shutil.copy(path, backup)
    try:
        for option, name in (([], "fix"), (["--grad-norm"], "grad-norm")):
            diff = session.run("python", "-m", "deepspeed_offload_patch", "diff", *option, silent=True, stderr=None)
            diff_file = os.path.join(REPORTS, f"{deepspeed}-{name}.diff")
            with open(diff_file, "w") as f:
                f.write(diff[diff.index("--- a/"):])
            session.run("patch",
                        "-p1",
                        "--quiet",
                        "--no-backup-if-mismatch",
                        "-d",
                        site,
                        "-i",
                        diff_file,
                        external=True)
        disabled = {"DS_OFFLOAD_PATCH_DISABLE": "1", "DS_OFFLOAD_PATCH_STRICT": "0"}
        enabled = {"DS_OFFLOAD_PATCH_DISABLE": "0", "DS_OFFLOAD_PATCH_STRICT": "0", "DS_OFFLOAD_PATCH_GRAD_NORM": "1"}
        status = _status(session, env=enabled)
        return {
            "diff_state":
            status["state"],
            "diff_grad_norm_state":
            status["grad_norm_on_device"],
            # Equivalence tests compare patched and unpatched processes; with the diff in the file, both sides run
            # the diff, so they would compare it with itself.
            "diff_tests":
            _pytest(session, f"{deepspeed}-diff", "-m", "not equivalence", "tests/unit/v1/zero", env=disabled),
        }
    finally:
        shutil.move(backup, path)


def _commit() -> str:
    import subprocess
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=ROOT,
                           capture_output=True,
                           text=True).stdout
    return head.strip() + ("+changes" if dirty.strip() else "")


def _ok(result: dict) -> bool:
    tests = result["tests"]
    ok = result["state"] == result["expected"] and tests["failed"] == 0 and tests["passed"] > 0
    if "diff_tests" in result:
        ok = (ok and result["diff_state"] == result["diff_grad_norm_state"] == "upstream-fixed"
              and result["diff_tests"]["failed"] == 0)
    return ok and tests["skipped"] == 0


@nox.session(python=False)
def matrix(session: nox.Session) -> None:
    """Every supported release and the unsupported one, then the table."""
    for version in list(PATCHED_RELEASES) + list(UNSUPPORTED):
        session.notify(f"release(deepspeed='{version}')", posargs=["core"])
    session.notify("table")


@nox.session(python=False)
def table(session: nox.Session) -> None:
    session.run(sys.executable, os.path.join(ROOT, "ci", "matrix_table.py"))


@nox.session
def sources(session: nox.Session) -> None:
    """The fingerprints and patches/ agree with the releases' own sdists (downloaded with pip)."""
    session.install("torch==2.13.0")
    session.install("deepspeed", "packaging", "yapf==0.43.0")
    session.install("pytest")
    session.install("--no-deps", "-e", ROOT)
    session.chdir(ROOT)
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/release/test_sources.py")
