# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The DeepSpeed version matrix: one reused virtualenv per release, torch 2.13.0 CPU.

    nox -f ci/noxfile.py -- core                  # one release per form and the first three variants (the default)
    nox -f ci/noxfile.py -s matrix                # every supported release and every variant, then the table
    nox -f ci/noxfile.py -s "release(deepspeed='0.18.4')" [-- core|lite] [stacks]
    nox -f ci/noxfile.py -s "scale(deepspeed='0.16.9')"   # 4 ranks: an mpu, MoE; fp32 accumulation (a representative)
    nox -f ci/noxfile.py -s "stacks(deepspeed='0.19.8')"  # HF Trainer, Accelerate, Lightning (a representative)
    nox -f ci/noxfile.py -s multinode             # two nodes on one machine: sshd + pdsh, torchrun c10d, 8 ranks
    nox -f ci/noxfile.py -s pipeline              # PipelineEngine, 2 stages x 2 data-parallel ranks, ZeRO-1 (0.19.8)
    nox -f ci/noxfile.py -s sequence              # Ulysses sequence parallelism on 2 ranks, ZeRO-2 (0.19.8)
    nox -f ci/noxfile.py -s ci-3.10 -- 0.16.9:core,ci,no-diff variants   # CI's steps on the floor Python, one virtualenv
    nox -f ci/noxfile.py -s ci-3.13 -- 0.17.1:smoke,fixes,no-diff 0.19.6:smoke,no-diff,stacks-launcher   # ... and on the newest
    nox -f ci/noxfile.py -s pythons               # each supported Python: the wheel, 0.19.8 and 0.16.9 (pythons-3.12: one)
    nox -f ci/noxfile.py -s sdists                # fetch the 47 releases' sdists into the cache (ci/sdists.py)
    nox -f ci/noxfile.py -s sources               # fingerprints and patches/ against the releases' sdists
    python ci/matrix_table.py [--readme]          # the tables of the last results (reports/matrix/, reports/layouts/);
                                                  # --readme writes them into ci/README.md

For a supported release, ``release`` checks that the import patches it (``status`` is ``applied``) and runs the test
suite: all of ``tests/unit``, or with the session argument ``core`` (``matrix`` passes it) the ZeRO regression tests
and ``tests/unit/test_guard.py`` plus ``ds-offload-patch check`` and ``verify`` (the rest of the suite tests the package's own mechanics, the same on
every release; the representative releases run it). Then it applies the release's diffs from ``patches/``
(the fix, the grad norm and, from 0.19.8, the skipped-step fix) to the installed DeepSpeed: the package must report
each as ``upstream-fixed``,
and with the monkey-patch disabled the ZeRO regression tests (but the equivalence tests, which would compare the
diffs with themselves) must pass on the diffs alone. The file is restored after. Each session writes
``reports/matrix/<release>.json``. A release outside the supported range is exercised by the ``variant`` sessions
(``truth-test`` must be refused as unsupported).

Sessions reuse their virtualenvs; the sdists come from one cache (``ci/sdists.py``), fetched once.
"""

import json
import os
import shutil
import sys
import xml.etree.ElementTree as ET
from typing import Optional

import nox
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "ci"))
from deepspeed_offload_patch import settings  # noqa: E402
from deepspeed_offload_patch.changes import CHANGES, OTHERS  # noqa: E402
from deepspeed_offload_patch.releases import PATCHED_RELEASES  # noqa: E402
from deepspeed_offload_patch.states import State  # noqa: E402
import pin  # noqa: E402
from pythons import FLOOR, NEWEST, SUPPORTED, find  # noqa: E402

# nox finds an interpreter by its version on PATH; pyenv's shims there do not run a version that is not active, so
# the supported interpreters this machine has (ci/pythons.py) go first.
os.environ["PATH"] = os.pathsep.join([os.path.dirname(path)
                                      for path in map(find, SUPPORTED) if path] + [os.environ.get("PATH", "")])

# One release per diff of the fix (three forms of the methods, four diffs: 0.19.7 changed _has_inf_or_nan's result):
# the last of the 0.14.0-0.17.0 form, the first of the 0.17.x form, the last of the 0.18.0-0.19.6 form (its check
# returns fp32) and the latest (0.19.7+: bool).
# CI runs 0.16.9 with "core,ci" (core without the 4-rank scale module and without its red/green run), 0.17.1 with
# "smoke", 0.19.6 with "smoke" and the training stacks, and the variants with "lite" (truth-test its own test,
# fixed-differently the sync tests on upstream's fixed code); not 0.19.8, whose whole suite (the scale module included) and red/green run ci/test.sh
# already ran in the checkout's own venv. The on-demand matrix runs 0.16.9's red/green run and `nox -s scale` the
# scale module on each form. None runs its diffs in CI (no-diff):
# test_sources.py checks them statically on every release.
REPRESENTATIVE = ("0.16.9", "0.17.1", "0.19.6", "0.19.8")
CI_RELEASES = ("0.16.9", "0.17.1", "0.19.6")
# Releases whose ZeRO suite also runs with the patch disabled (ci/check_red_green.py) in the on-demand matrix: the
# per-parameter form (ci/test.sh does it for the installed 0.19.8; CI's 0.16.9 step, "ci", leaves it out).
RED_GREEN = ("0.16.9", )
# DeepSpeed built from 0.19.8's own sdist with changes: (version.txt, what is done to stage_1_and_2.py, the state the
# package must report). The default sessions run the first three; ``nox -s variants``, CI_VARIANTS.
VARIANTS = {
    "0.19.9": ("0.19.9", None, State.APPLIED),
    "truth-test": ("0.19.9", "truth-test", State.UNSUPPORTED),
    "fixed-differently": ("0.20.0", "fixed-differently", State.UPSTREAM_FIXED),
    "0.20.0.dev0": ("0.20.0.dev0", None, State.APPLIED),
}
# A variant's states that its release's forms do not give: fixed-differently's step() drops the compact buffers
# itself, so the skipped-step fix finds upstream's fix there.
VARIANT_CHANGES = {"fixed-differently": {"skipped-step": State.UPSTREAM_FIXED}}


def changes_result(status: dict, release: str, variant: str = "", fixed: bool = False) -> dict:
    """Each change beside the upstream one, by its key in ``status --json``: the state ``status`` read (``changes``)
    and the one it must read (``changes_expected``): applied where the release has a form of the change
    (upstream-fixed with the diffs applied, ``fixed``), not-needed where it has none, off for an opt-in change with
    the default switches, or the variant's own."""
    expected = {}
    for change in OTHERS:
        state = (State.UPSTREAM_FIXED if fixed else State.APPLIED) if change.covers(release) else State.NOT_NEEDED
        if change.opt_in and not fixed:  # off unless switched on (the diff step switches every change on)
            state = State.OFF
        expected[change.state_key] = VARIANT_CHANGES.get(variant, {}).get(change.name, state)
    return {"changes": {key: status.get(key) for key in expected}, "changes_expected": expected}


# Releases that do not import with torch 2.13.0 (their elastic agent imports torch's _get_socket_with_port, which torch
# 2.5.1 and later no longer have): the torch they run on, with numpy 1 (their autotuner imports numpy.BUFSIZE).
OLDER_TORCH = {release: ("torch==2.3.1", "numpy<2") for release in ("0.14.1", "0.14.2", "0.14.3")}
# Releases the CPU matrix cannot run: 0.14.0 does not import with torch 2.13.0 either, and with torch 2.3.1 its CPU
# accelerator requires intel_extension_for_pytorch, which the registry has from 2.6 only (for torch 2.6+, where 0.14.0
# does not import). Its methods are those of 0.14.1 - 0.17.0 (the fingerprints) and its diff applies (sources).
NOT_ON_CPU = ("0.14.0", )
VARIANT_BASE = "0.19.8"
REPORTS = os.path.join(ROOT, "reports", "matrix")
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = [f"release(deepspeed='{v}')"
                        for v in REPRESENTATIVE] + [f"variant(kind='{k}')" for k in list(VARIANTS)[:3]]
# The quick variants (``nox -s variants``, on demand): the edited trackers. In CI the suite's synthetic classes make
# the same decisions (test_guard.py), and test_a_newer_release_with_a_known_form_is_patched_with_one_info_line_per_change
# and test_the_upstream_watch_passes_on_the_newest_release prove what the 0.19.9 build would.
CI_VARIANTS = ("truth-test", "fixed-differently")
nox.options.envdir = os.path.join(ROOT, ".nox")


def _constrain(session: nox.Session, *own: str) -> None:
    """Install with the pinned test environment (``ci/constraints.txt``) for the rest of the session, less what the
    session installs at versions of its own: DeepSpeed, torch and ``own`` (``numpy<2`` beside an older torch). A
    session that installs several releases calls it again before each."""
    with open(pin.CONSTRAINTS) as f:
        text = pin.without(f.read(), ("deepspeed", "torch", *own))
    path = os.path.join(session.virtualenv.location, "constraints.txt")
    with open(path, "w") as f:
        f.write(text)
    session.env["PIP_CONSTRAINT"] = path


def _install_torch(session: nox.Session, *specs: str) -> None:
    """torch first (a bare DeepSpeed install would pull the newest CUDA build of torch), from ``$TORCH_INDEX_URL``
    when it is set (``https://download.pytorch.org/whl/cpu`` for the CPU build on an ordinary machine). Every later
    install of the session is constrained to the pinned test environment (:func:`_constrain`)."""
    _constrain(session, *specs)
    index = os.environ.get("TORCH_INDEX_URL")
    torch = [spec for spec in specs if spec.startswith("torch")]
    session.install(*torch, *(["--index-url", index] if index else []))
    if len(torch) < len(specs):
        session.install(*[spec for spec in specs if not spec.startswith("torch")])


def _install(session: nox.Session, version: str, ops: bool = True) -> None:
    """Install torch, DeepSpeed ``version``, the test tools and the checkout into the session's virtualenv; then
    build DeepSpeed's CPU shm op in one process (:func:`_build_ops`), or, with ``ops=False`` (a step whose tests run
    only the package's own ranks, which turn the op off), give the release an empty ``TORCH_EXTENSIONS_DIR`` that
    :func:`_nothing_built` checks afterwards."""
    _install_torch(session, *OLDER_TORCH.get(version, ("torch==2.13.0", )))
    _install_deepspeed(session, version, ops)


def _install_deepspeed(session: nox.Session, version: str, ops: bool, label: str = "") -> None:
    """DeepSpeed ``version``, the test tools and the checkout over the torch the session installed, then the op build
    or the empty ``TORCH_EXTENSIONS_DIR`` (:func:`_install`), named after ``label`` (default: the release)."""
    # sybil: the checkout's conftest.py imports it (the documents run as tests), so pytest needs it for any path.
    session.install(f"deepspeed=={version}", "pytest", "packaging", "sybil")
    session.install("--no-deps", "--force-reinstall", ROOT)
    _verify_pins(session)
    if ops:
        _build_ops(session, label or version)
    else:
        _extensions_dir(session, label or version, empty=True)


def _verify_pins(session: nox.Session) -> None:
    """Fail the session if what it installed differs from the pins it installed with (a virtualenv reused from
    before the pins changed keeps its old versions: ``nox -R`` is not enough then, ``rm -r .nox`` is)."""
    session.run("python", os.path.join(ROOT, "ci", "pin.py"), "--verify", "--constraints",
                session.env["PIP_CONSTRAINT"])


def _extensions_dir(session: nox.Session, label: str, empty: bool = False) -> None:
    """Give the DeepSpeed just installed its own ``TORCH_EXTENSIONS_DIR`` (``torch_extensions-<label>`` in the
    virtualenv: releases overwrite each other's JIT builds in a shared one, and the ci sessions install several in one
    virtualenv); ``empty``: remove what an earlier run built there."""
    folder = os.path.join(session.virtualenv.location, f"torch_extensions-{label}")
    if empty and os.path.exists(folder):
        shutil.rmtree(folder)
    session.env["TORCH_EXTENSIONS_DIR"] = folder


def _build_ops(session: nox.Session, label: str) -> None:
    """Build DeepSpeed's CPU shm op in the release's own ``TORCH_EXTENSIONS_DIR`` now, in this one process: no
    multi-rank job a test launches is then the first to need it (two ranks that both build it race, and on a loaded
    machine one loses)."""
    _extensions_dir(session, label)
    session.run("python", "-m", "deepspeed_offload_patch.cpu_shm", "build")


def _nothing_built(session: nox.Session) -> None:
    """Fail the session if anything JIT-built an op into the ``TORCH_EXTENSIONS_DIR`` that :func:`_install` left
    empty: a step that skips the build must launch no rank that loads the op (a launcher's ranks would race to build
    it)."""
    folder = session.env["TORCH_EXTENSIONS_DIR"]
    built = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if built:
        session.error(f"{folder} was to stay empty (no launcher in this step), but holds {built}: build the ops first")


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


def _red_green(session: nox.Session, *args, env=None) -> tuple:
    """Run ``ci/check_red_green.py`` on ``args`` (the modules with the patch disabled: exactly the tests marked
    ``fails_unpatched`` must fail); return whether it passed, read from its verdict line (``session.run`` returns
    True for every allowed exit code), and the counts of its junit report."""
    out = session.run("python", "ci/check_red_green.py", *args, env=env, silent=True, success_codes=[0, 1])
    session.log("\n".join(out.splitlines()[-40:]))
    return "red/green: OK" in out, _junit_counts(os.path.join(ROOT, "reports", "unpatched.xml"))


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
@nox.parametrize("deepspeed", list(PATCHED_RELEASES))
def release(session: nox.Session, deepspeed: str) -> None:
    """Test the package against one DeepSpeed release.

    The mechanics suite (``tests/unit`` outside ``v1/zero``) is written for the current form of DeepSpeed's methods
    (0.17.1 and later); releases 0.14.0 - 0.17.0 run the ZeRO suite, ``tests/unit/test_guard.py``, ``check`` and
    ``verify``, as ``core`` does. With ``stacks`` among the arguments, ``tests/stacks`` too (see :func:`stacks`);
    with ``smoke``, only ``check``, ``verify`` and the boundary-backward sync tests (CI's 0.19.6 step, whose training
    stacks then run the patch end to end); with ``no-diff``, not the run on the release's diffs (CI's steps:
    ``tests/release/test_sources.py`` has checked that they apply, equal the monkey-patch and read only names their
    module defines; the on-demand matrix runs them).
    """
    _release(session, deepspeed, session.posargs)


def _release(session: nox.Session, deepspeed: str, profiles) -> None:
    os.makedirs(REPORTS, exist_ok=True)
    suite = next((p for p in ("smoke", "lite") if p in profiles), None)
    if suite is None:
        suite = "core" if "core" in profiles or Version(deepspeed) < Version("0.17.1") else "suite"
    # Only the stacks' launchers and the whole mechanics suite start ranks that load DeepSpeed's CPU shm op; smoke,
    # lite and core start only the package's own ranks (testing.launch.run_distributed, verify), which turn it off.
    ops = "stacks" in profiles or "stacks-launcher" in profiles or suite == "suite"
    _install(session, deepspeed, ops=ops)
    session.chdir(ROOT)
    status = _status(session, env=CLEAN)
    result = {"release": deepspeed, "state": status["state"], "expected": State.APPLIED}
    result.update(changes_result(status, deepspeed))
    result["torch"] = session.run("python", "-c", "import torch; print(torch.__version__)", silent=True).split()[-1]
    if suite == "smoke":
        result.update(_smoke(session, deepspeed, fixes="fixes" in profiles))
    elif suite == "lite":
        result.update(_lite(session, deepspeed))
    else:
        result.update(_suite(session, deepspeed, core=suite == "core", ci="ci" in profiles))
    if "no-diff" not in profiles:
        result.update(_with_diff(session, deepspeed))
    if not ops:
        _nothing_built(session)
    _finish(session, deepspeed, result)
    if "stacks" in profiles:
        _stacks(session, deepspeed)
    elif "stacks-launcher" in profiles:
        # CI's cut: each stack once patched, through `ds-offload-patch run` (the route that must reach every rank);
        # the import route and the red/green run are the on-demand stacks session's.
        _stacks(session, deepspeed, routes=("launcher", ), red_green=False)


@nox.session(python=[FLOOR, NEWEST])
def ci(session: nox.Session) -> None:
    """CI's part of the matrix in one virtualenv per Python, so that torch and the tools are installed once: each
    argument is a step, ``RELEASE:PROFILE[,PROFILE]`` (``0.16.9:core,ci,no-diff``, ``0.19.6:smoke,no-diff,stacks-launcher``) or ``variants``;
    each release is installed over the last (``.ci/run`` calls it once per step, so that each prints its time). The
    results are those of the ``release``, ``stacks`` and ``variants`` sessions. ``ci-3.10`` and ``ci-3.13`` run on
    the oldest and the newest supported Python, so that every landing proves both (``ci/test.sh`` runs on the
    machine's ``python3``)."""
    for step in session.posargs:
        if step == "variants":
            _ci_variants(session)
            continue
        deepspeed, _, profiles = step.partition(":")
        _release(session, deepspeed, profiles.split(","))


CLEAN = {settings.DISABLE: "0", settings.STRICT: "0"}


def _suite(session: nox.Session, name: str, core: bool, ci: bool = False) -> dict:
    """The release's suite (``core``: the ZeRO tests, ``test_guard.py``, ``check`` and ``verify``) and, for a release
    in ``RED_GREEN``, its red/green run. With ``ci`` (CI's 0.16.9 step), neither the 4-rank scale module nor the
    red/green run: ``ci/test.sh`` has run both on 0.19.8, and the on-demand matrix and ``nox -s scale`` run them on
    every form."""
    if core:
        suite = ["tests/unit/v1/zero", "tests/unit/test_guard.py"]
        if ci:
            suite += ["--deselect", "tests/unit/v1/zero/test_offload_scale.py"]
        session.run("python", "-m", "deepspeed_offload_patch", "check", env=CLEAN)
        session.run("python", "-m", "deepspeed_offload_patch", "verify", env=CLEAN)
    else:
        suite = ["tests/unit"]
    result = {"suite": " ".join(suite), "tests": _pytest(session, name, *suite, env=CLEAN)}
    if name in RED_GREEN and not ci:
        # The ZeRO suite with the patch disabled fails exactly the tests marked fails_unpatched.
        done, _ = _red_green(session, "tests/unit/v1/zero", env=CLEAN)
        result["red_green"] = "pass" if done else "FAIL"
    return result


def _lite(session: nox.Session, name: str, check: bool = True) -> dict:
    """``lite``: the ZeRO regression tests but the equivalence ones, ``check`` and ``verify`` (unless ``check`` is
    False: the caller ran them). For a release whose methods are byte for byte those of a representative release that
    ran ``core`` (the fingerprints say which)."""
    if check:
        session.run("python", "-m", "deepspeed_offload_patch", "check", env=CLEAN)
        session.run("python", "-m", "deepspeed_offload_patch", "verify", env=CLEAN)
    suite = ["-m", "not equivalence", "tests/unit/v1/zero"]
    return {"suite": "tests/unit/v1/zero (not equivalence)", "tests": _pytest(session, name, *suite, env=CLEAN)}


def _python(session: nox.Session) -> str:
    """The version of the session's interpreter (``3.13.0``)."""
    out = session.run("python", "-c", "import platform; print(platform.python_version())", silent=True)
    return out.split()[-1]


def _finish(session: nox.Session, name: str, result: dict, folder: str = REPORTS) -> None:
    result.setdefault("python", _python(session))
    result["commit"] = _commit()
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    session.log(json.dumps(result))
    if not _ok(result):
        session.error(f"DeepSpeed {name}: {result}")


LAYOUTS = os.path.join(ROOT, "reports", "layouts")
SCALE_TESTS = ("tests/unit/v1/zero/test_offload_scale.py", "tests/unit/v1/zero/test_offload_equivalence.py",
               "tests/unit/v1/zero/test_offload_overflow_flag.py")


@nox.session
@nox.parametrize("deepspeed", list(REPRESENTATIVE))
def scale(session: nox.Session, deepspeed: str) -> None:
    """The group layouts and accumulation dtypes real jobs run, on one release: 4 ranks in 2 data-parallel x 2
    model-parallel groups (a Megatron-shaped ``mpu``) and with MoE expert parallelism (``test_offload_scale.py``),
    fp32 gradient accumulation in the covering array and in the sync test. Then the scale tests with the patch
    disabled: exactly their zero-sync tests must fail. Writes ``reports/layouts/scale-<release>.json`` with the host
    syncs per boundary backward (unpatched, patched) and the run time of each configuration."""
    os.makedirs(LAYOUTS, exist_ok=True)
    _install(session, deepspeed)
    session.chdir(ROOT)
    version = session.run("python", "-c", "import deepspeed; print(deepspeed.__version__)", silent=True).split()[-1]
    measured = os.path.join(ROOT, "reports", "scale", f"{version}.json")  # written by test_offload_scale.py
    if os.path.exists(measured):
        os.remove(measured)
    tests = _pytest(session, f"scale-{deepspeed}", *SCALE_TESTS, env=CLEAN)
    unpatched = _pytest(session,
                        f"scale-{deepspeed}-unpatched",
                        "-m",
                        "not equivalence",
                        SCALE_TESTS[0],
                        env=dict(CLEAN, **{settings.DISABLE: "1"}))
    # Without the patch the scale module's non-equivalence tests are its zero-sync tests: every one must fail.
    more = {}
    if os.path.exists(measured):
        with open(measured) as f:
            more["runs"] = json.load(f)["runs"]
    _finish_layout(session, "scale", deepspeed, tests, unpatched, more)


def _finish_layout(session: nox.Session, kind: str, deepspeed: str, tests: dict, unpatched: Optional[dict],
                   more: dict) -> None:
    """Write ``reports/layouts/<kind>-<release>.json``; fail unless every test passed and, with the patch disabled,
    every test that ran failed (the red/green run; ``unpatched`` None: none ran, and the JSON says so)."""
    result = {
        "kind": kind,
        "release": deepspeed,
        "python": _python(session),
        "tests": tests,
        "unpatched": unpatched,
        **more
    }
    # A session whose red/green run also holds tests that pass unpatched passes its own verdict in ``more``.
    if unpatched is not None:
        result.setdefault("red_green", "pass" if unpatched["failed"] and not unpatched["passed"] else "FAIL")
    result["commit"] = _commit()
    with open(os.path.join(LAYOUTS, f"{kind}-{deepspeed}.json"), "w") as f:
        json.dump(result, f, indent=2)
    session.log(json.dumps({k: result.get(k, "not run") for k in ("release", "tests", "red_green")}))
    if tests["failed"] or tests["skipped"] or not tests["passed"] or result.get("red_green", "pass") != "pass":
        session.error(f"DeepSpeed {deepspeed}: {kind} {result}")


def _variant_tools(session: nox.Session) -> None:
    os.makedirs(REPORTS, exist_ok=True)
    _install_torch(session, "torch==2.13.0")
    session.install("pytest", "packaging", "setuptools", "wheel")


@nox.session
@nox.parametrize("kind", list(VARIANTS))
def variant(session: nox.Session, kind: str) -> None:
    """DeepSpeed built from 0.19.8's own sdist with its version.txt changed (a later release, a dev build), or with
    its tracker edited (see ``ci/variants.py``): the package must report the state in ``VARIANTS``. Applied builds
    run the ZeRO suite; a fix in other words must pass ``check`` (exit 0) and the non-equivalence ZeRO tests on
    DeepSpeed's own fixed code (the package reports it upstream-fixed and patches nothing of the fix); an edited
    tracker that still truth-tests must be refused as on an unknown release. Each also runs the upstream watch's
    command, which must pass or fail accordingly."""
    _variant_tools(session)
    _variant(session, kind, "lite" if "lite" in session.posargs else "core")


@nox.session
def variants(session: nox.Session) -> None:
    """The quick variants (:data:`CI_VARIANTS`; CI ran them until the suite's synthetic classes took their place) in
    one virtualenv, each build installed over the last: torch and the tools
    are installed once: ``truth-test`` (which must read ``unsupported``) its own test, ``fixed-differently`` the sync
    tests on upstream's fixed code (``lite``), each with its state and the upstream watch."""
    _ci_variants(session)


def _ci_variants(session: nox.Session) -> None:
    _variant_tools(session)
    for kind in CI_VARIANTS:
        _variant(session, kind, "lite")


def _variant(session: nox.Session, kind: str, profile: str) -> None:
    version, edit, expected = VARIANTS[kind]
    session.chdir(ROOT)
    tree = session.run("python",
                       os.path.join(ROOT, "ci", "variants.py"),
                       VARIANT_BASE,
                       version,
                       edit or "none",
                       silent=True).strip().splitlines()[-1]
    # DeepSpeed's own requirements, then the build over whatever DeepSpeed the virtualenv holds (in a shared or reused
    # one, another build may carry the same version number, which a plain install would take as already there).
    session.install("-r", os.path.join(tree, "requirements", "requirements.txt"))
    session.install("--no-build-isolation", "--no-deps", "--force-reinstall", tree)
    session.install("--no-deps", "--force-reinstall", ROOT)
    result = {"release": version, "variant": f"{VARIANT_BASE} sdist, {kind}", "expected": expected}
    status = _status(session, env=CLEAN)
    result.update(state=status["state"], **changes_result(status, version, kind))
    result["watch"] = _watch(session, kind, should_pass=expected != State.UNSUPPORTED)
    if expected == State.APPLIED:
        result.update(_lite(session, kind) if profile == "lite" else _suite(session, kind, core=True))
    elif expected == State.UPSTREAM_FIXED:
        session.run("python", "-m", "deepspeed_offload_patch", "check", env=CLEAN)
        # The package patches nothing of the fix here: the tests run on DeepSpeed's own fixed code. (The equivalence
        # tests would compare that code with itself.) CI (lite) runs the boundary-backward sync tests; the on-demand
        # session (core) the whole ZeRO suite.
        if profile == "core":
            suite = ["-m", "not equivalence", "tests/unit/v1/zero"]
        else:
            suite = ["tests/unit/v1/zero/test_offload_overflow_flag.py", "-k", "boundary_backward_has_no_host_sync"]
        result["suite"] = " ".join(suite)
        result["tests"] = _pytest(session, kind, *suite, env=CLEAN)
    else:
        result["suite"] = "tests/release/test_unsupported_release.py"
        result["tests"] = _pytest(session, kind, "tests/release/test_unsupported_release.py", env=CLEAN)
    _finish(session, f"variant-{kind}", result)


#: The tests of the fix that only 0.17.x needs: CI's ``fixes`` profile runs them on 0.17.1 (the bf16-check default,
#: which 0.17.1 - 0.19.2 need, has its cell in ``verify`` there: a bf16 job whose config leaves the check out).
FIXES_OF_0_17 = ("tests/unit/v1/zero/test_offload_rank_agreement.py", )


def _smoke(session: nox.Session, name: str, fixes: bool = False) -> dict:
    """``smoke``: ``check``, ``verify`` and the boundary-backward sync tests: in CI for the forms whose whole suite
    only the on-demand matrix runs (0.17.1, 0.19.6: CI's time goes to 0.19.8's whole suite and 0.16.9's core). With
    ``fixes``, also the tests of the fixes that no release of CI's other steps needs (:data:`FIXES_OF_0_17`)."""
    session.run("python", "-m", "deepspeed_offload_patch", "check", env=CLEAN)
    session.run("python", "-m", "deepspeed_offload_patch", "verify", env=CLEAN)
    files = ["tests/unit/v1/zero/test_offload_overflow_flag.py"] + list(FIXES_OF_0_17 if fixes else ())
    chosen = " or ".join(["boundary_backward_has_no_host_sync"] + [os.path.basename(path)[:-3] for path in files[1:]])
    suite = "boundary-backward sync tests" + (", the rank-agreement fix's tests" if fixes else "")
    return {"suite": suite, "tests": _pytest(session, name, *files, "-k", chosen, env=CLEAN)}


def _watch(session: nox.Session, name: str, should_pass: bool) -> dict:
    """The upstream watch's own command, read from its workflow, on this build: it must pass where the fix is active
    and fail, naming the method whose code is new, where it is not."""
    sys.path.insert(0, os.path.join(ROOT, "ci"))
    from upstream_watch import TEMPLATE, template_command
    report = os.path.join(REPORTS, f"watch-{name}.md")
    command = [report if arg == "watch.md" else arg for arg in template_command(os.path.join(ROOT, TEMPLATE))]
    out = session.run(*command, env=CLEAN, silent=True, success_codes=[0, 1])
    line = next((line for line in out.splitlines() if line.startswith("upstream watch:")), out[-500:])
    session.log(line)
    passed = line.startswith("upstream watch: OK")
    names_new_form = "new forms: update_offload_overflow_tracker (" in line and "fingerprint" in line
    return {"line": line, "as_expected": passed if should_pass else (not passed and names_new_form)}


def _with_diff(session: nox.Session, deepspeed: str) -> dict:
    """Apply the release's diff of each change that has a form (or its unfixed default) there to the installed files;
    then, with the monkey-patch disabled, each must read as upstream-fixed and the ZeRO tests must pass on the diffs
    alone."""
    site = _site_packages(session)
    # Each change's diff for this release (diff's default is the upstream change's), and the files they patch.
    chosen = [change for change in CHANGES if change.covers(deepspeed)]
    options = [([] if change.upstream else [f"--{change.name}"], change.name) for change in chosen]
    # Kept aside (not where patch writes its .orig) and put back after.
    backups = {
        os.path.join(site, path): os.path.join(REPORTS, f"{deepspeed}-{os.path.basename(path)}.original")
        for path in dict.fromkeys(change.target.path for change in chosen)
    }
    for path, backup in backups.items():
        shutil.copy(path, backup)
    try:
        for option, name in options:
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
        disabled = {settings.DISABLE: "1", settings.STRICT: "0"}
        enabled = {settings.DISABLE: "0", settings.STRICT: "0", **{c.switch: "1" for c in CHANGES if c.switch}}
        status = _status(session, env=enabled)
        applied = changes_result(status, deepspeed, fixed=True)
        return {
            "diff_changes":
            applied["changes"],
            "diff_changes_expected":
            applied["changes_expected"],
            "diff_state":
            status["state"],
            # Equivalence tests compare patched and unpatched processes; with the diff in the file, both sides run
            # the diff, so they would compare it with itself.
            "diff_tests":
            _pytest(session, f"{deepspeed}-diff", "-m", "not equivalence", "tests/unit/v1/zero", env=disabled),
        }
    finally:
        for path, backup in backups.items():
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
    sys.path.insert(0, os.path.join(ROOT, "ci"))
    from matrix_table import passed
    return passed(result)


# The releases the ``pythons`` session runs on each interpreter: the newest, and one of the 0.14.0 - 0.17.0 form.
PYTHON_RELEASES = ("0.19.8", "0.16.9")
# What it runs of the suite besides ``lite``: two runs trained patched and unpatched on 2 ranks, ZeRO-2 with a fault
# on one rank (bf16, fp16), compared bit for bit, with no host sync in any patched boundary backward.
SAME_BITS = ("tests/unit/v1/zero/test_offload_faults.py", "-k", "same_bits_as_unpatched and one-rank and s2")


@nox.session(python=list(SUPPORTED))
def pythons(session: nox.Session) -> None:
    """The package on one supported Python, as a user there meets it: a fresh virtualenv with torch 2.13.0 and the
    package's wheel (built here, installed by file); for each of ``PYTHON_RELEASES``, ``ds-offload-patch status``
    must read ``applied`` and ``check`` and ``verify`` pass when run outside the checkout (so the wheel's code runs),
    then ``SAME_BITS``. With the first release it also runs ``lite`` (the ZeRO regression tests but the equivalence
    ones), the guard's tests, and what reads source code on that interpreter: ``gen_fingerprints.py --check``,
    ``make_patches.py --check`` (whose AST-equality check of the diffs needs DeepSpeed and torch) against the sdists,
    and ``new_form.py``.
    Writes ``reports/matrix/python-<X.Y>-<release>.json`` (the matrix's table names the Python of each row).

        nox -f ci/noxfile.py -s pythons-3.13      # one interpreter
    """
    _install_torch(session, "torch==2.13.0")
    wheels = session.create_tmp()
    session.run("python", "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", wheels, ROOT)
    wheel = next(os.path.join(wheels, name) for name in sorted(os.listdir(wheels)) if name.endswith(".whl"))
    outside = os.path.join(wheels, "outside")
    os.makedirs(outside, exist_ok=True)
    for deepspeed in PYTHON_RELEASES:
        session.install(f"deepspeed=={deepspeed}", "pytest", "packaging")
        session.install("--no-deps", "--force-reinstall", wheel)
        _build_ops(session, deepspeed)
        session.chdir(outside)  # the checkout is not on sys.path: the installed wheel is what runs
        result = {"release": deepspeed, "package": "wheel", "expected": State.APPLIED}
        status = _status(session, env=CLEAN)
        result.update(state=status["state"], **changes_result(status, deepspeed))
        session.run("ds-offload-patch", "check", env=CLEAN)
        session.run("ds-offload-patch", "verify", env=CLEAN)
        session.chdir(ROOT)
        name = f"python-{session.python}-{deepspeed}"
        if deepspeed == PYTHON_RELEASES[0]:
            session.run("python", "ci/gen_fingerprints.py", "--check", env=CLEAN)
            session.run("python", "ci/make_patches.py", "--check", env=CLEAN)
            session.run("python", "ci/new_form.py", env=CLEAN)
            result.update(_lite(session, name, check=False))
            # The guard's probes of synthetic classes (fixed in other words, still reading the host) and the digest's
            # rules, on this interpreter.
            more = _pytest(session,
                           f"{name}-guard",
                           "tests/unit/test_guard.py",
                           "tests/unit/test_source_digest.py",
                           env=CLEAN)
            result["tests"] = {key: result["tests"][key] + more[key] for key in result["tests"]}
            result["suite"] += " + the guard"
        else:
            result.update(suite="", tests={"passed": 0, "failed": 0, "skipped": 0})
        same = _pytest(session, f"{name}-same-bits", *SAME_BITS, env=CLEAN)
        result["tests"] = {key: result["tests"][key] + same[key] for key in result["tests"]}
        result["suite"] = " + ".join(part for part in (result["suite"], "2-rank ZeRO-2 bit identity") if part)
        _finish(session, f"python-{session.python}-{deepspeed}", result)


# The release the newest torch runs with: the newest DeepSpeed the package knows; and where its results go (not among
# the matrix's, whose rows are one per release and Python).
NEWEST_TORCH_RELEASE = "0.19.8"
TORCH_REPORTS = os.path.join(ROOT, "reports", "torch")


def _torch_requirements(session: nox.Session) -> list:
    """The names the installed torch requires (``nvidia-*`` and ``triton`` in a CUDA build), read from its
    metadata."""
    code = ("import importlib.metadata as m, re; "
            "print(' '.join(re.match(r'[A-Za-z0-9._-]+', r).group(0) for r in (m.requires('torch') or [])))")
    return session.run("python", "-c", code, silent=True).split()


@nox.session
def newest_torch(session: nox.Session) -> None:
    """The newest torch on the index with DeepSpeed :data:`NEWEST_TORCH_RELEASE`, as a user who upgrades torch meets
    the package: ``status`` must read ``applied`` with each change as on torch 2.13.0, ``check`` and ``verify`` pass,
    the boundary-backward sync tests and ``SAME_BITS`` (2 ranks, patched and unpatched bit for bit) pass. torch is
    installed with the machine's pip configuration bypassed (``PIP_CONFIG_FILE`` set to the null device, no
    constraint: a machine may cap torch below the newest), from ``$TORCH_INDEX_URL`` or PyPI (a CUDA build there,
    several GB); the rest keeps the pinned test environment, less torch and what torch requires. Writes
    ``reports/torch/torch-<version>.json``. On demand, not in CI: the newest torch changes without a commit here.

        nox -f ci/noxfile.py -s newest_torch
    """
    os.makedirs(TORCH_REPORTS, exist_ok=True)
    session.env["PIP_CONFIG_FILE"] = os.devnull
    session.env["PIP_CONSTRAINT"] = ""
    index = os.environ.get("TORCH_INDEX_URL")
    session.install("--upgrade", "torch", *(["--index-url", index] if index else []))
    torch = session.run("python", "-c", "import torch; print(torch.__version__)", silent=True).split()[-1]
    freed = {"deepspeed", "torch", *_torch_requirements(session)}
    with open(pin.CONSTRAINTS) as f:
        lines = pin.without(f.read(), freed).splitlines()
    path = os.path.join(session.virtualenv.location, "constraints.txt")
    with open(path, "w") as f:  # CUDA builds pin nvidia-* packages of their own, named or not in torch's metadata
        f.write("\n".join(line for line in lines if not line.startswith(("nvidia-", "triton"))) + "\n")
    session.env["PIP_CONSTRAINT"] = path
    # The steps below start only the package's own ranks, which turn DeepSpeed's CPU shm op off.
    _install_deepspeed(session, NEWEST_TORCH_RELEASE, ops=False, label=f"torch-{torch}")
    session.chdir(ROOT)
    name = f"torch-{torch.split('+')[0]}"
    result = {"release": NEWEST_TORCH_RELEASE, "expected": State.APPLIED, "torch": torch}
    status = _status(session, env=CLEAN)
    result.update(state=status["state"], **changes_result(status, NEWEST_TORCH_RELEASE))
    result.update(_smoke(session, name))
    same = _pytest(session, f"{name}-same-bits", *SAME_BITS, env=CLEAN)
    result["tests"] = {key: result["tests"][key] + same[key] for key in result["tests"]}
    result["suite"] += " + 2-rank ZeRO-2 bit identity"
    _nothing_built(session)
    _finish(session, name, result, folder=TORCH_REPORTS)


@nox.session(python=False)
def matrix(session: nox.Session) -> None:
    """Every supported release and every variant, then the table."""
    for version in PATCHED_RELEASES:
        if version not in NOT_ON_CPU:
            session.notify(f"release(deepspeed='{version}')", posargs=["core"])
    for kind in VARIANTS:
        session.notify(f"variant(kind='{kind}')")
    session.notify("table")


STATES = os.path.join(ROOT, "reports", "states.json")


@nox.session
def states(session: nox.Session) -> None:
    """The state of each change on every supported release, read by ``status --json`` with nothing else run: each
    PyPI release installed in turn into one virtualenv (those of ``OLDER_TORCH`` last, on their torch). The sync fix
    must read ``applied``, the on-device grad norm ``applied``, the skipped-step fix ``not-needed`` before 0.19.8 and
    ``applied`` from it on (the variants
    session shows ``upstream-fixed`` on a build with upstream's own fix). Writes ``reports/states.json``; fails on any
    other state."""
    session.chdir(ROOT)
    found = {}
    order = [v for v in PATCHED_RELEASES if v not in NOT_ON_CPU and v not in OLDER_TORCH] + list(OLDER_TORCH)
    current_torch = None
    for version in order:
        torch = OLDER_TORCH.get(version, ("torch==2.13.0", ))
        if torch != current_torch:
            _install_torch(session, *torch)
            current_torch = torch
        session.install(f"deepspeed=={version}", "packaging")
        if not found:
            session.install("--no-deps", "--force-reinstall", ROOT)
        status = _status(session, env=CLEAN)
        found[version] = {
            "state": status["state"],
            "expected": State.APPLIED,
            **changes_result(status, version),
            "torch": torch[0].split("==")[1],
        }
        session.log(f"DeepSpeed {version}: {found[version]}")
    result = {"python": _python(session), "commit": _commit(), "not_on_cpu": list(NOT_ON_CPU), "releases": found}
    with open(STATES, "w") as f:
        json.dump(result, f, indent=2)
    sys.path.insert(0, os.path.join(ROOT, "ci"))
    from matrix_table import states_as_expected

    wrong = [v for v, r in found.items() if not states_as_expected(r)]
    if wrong:
        session.error(f"unexpected states: {', '.join(wrong)}")


#: One release per form of each method the oracle reaches: before and after 0.15.2's accumulation change, the
#: releases between, 0.18.x, and the fixed 0.19.x.
ORACLE_RELEASES = ("0.14.4", "0.15.1", "0.15.4", "0.16.9", "0.17.6", "0.18.9", "0.19.8")
#: One release per form of the methods an inf meets (the norm's integer sentinel before 0.17.1, the 0.17.x flag
#: all-reduce, 0.18.x, 0.19.7's masked norm, 0.19.8's fix).
OUTCOME_RELEASES = ("0.14.4", "0.16.9", "0.17.6", "0.18.9", "0.19.7", "0.19.8")


def _record(session: nox.Session, deepspeed: str, name: str) -> None:
    """Install ``deepspeed``, run ``deepspeed_offload_patch.testing.<name>`` into ``docs/<name>/<release>.json`` (the
    session's arguments passed on), then render docs/releases.md's table with ``ci/<name>_table.py``."""
    _install(session, deepspeed)
    session.chdir(ROOT)
    folder = os.path.join(ROOT, "docs", name)
    os.makedirs(folder, exist_ok=True)
    session.run("python",
                "-m",
                f"deepspeed_offload_patch.testing.{name}",
                "--json",
                os.path.join(folder, f"{deepspeed}.json"),
                *session.posargs,
                env=CLEAN)
    session.run(sys.executable, os.path.join(ROOT, "ci", f"{name}_table.py"))


@nox.session
@nox.parametrize("deepspeed", list(ORACLE_RELEASES))
def oracle(session: nox.Session, deepspeed: str) -> None:
    """The whole differential oracle (``deepspeed_offload_patch/testing/oracle.py``: every ZeRO stage, accumulation
    1 - 4 and 4 backwards per step, clipping on and off, fp32 and bf16) on one release, unpatched and patched, each
    trained twice; writes ``docs/oracle/<release>.json``, from which ``ci/oracle_table.py`` renders docs/releases.md's
    table. Fails when a patched cell is not right."""
    _record(session, deepspeed, "oracle")


@nox.session
@nox.parametrize("deepspeed", list(OUTCOME_RELEASES))
def outcomes(session: nox.Session, deepspeed: str) -> None:
    """What one inf does to an offload job (``deepspeed_offload_patch/testing/outcomes.py``: every ZeRO stage, every
    precision, bf16's check on, off and left out, accumulation 1 and 2) on one release, unpatched and patched, each
    cell in fresh ranks; writes ``docs/outcomes/<release>.json``, from which ``ci/outcomes_table.py`` renders
    docs/releases.md's table. ``-- --every`` adds a NaN and a fault on every rank (4 x the cells); ``-- --stage 3``
    retrains one stage's rows and keeps the others."""
    _record(session, deepspeed, "outcomes")


@nox.session(python=False)
def table(session: nox.Session) -> None:
    session.run(sys.executable, os.path.join(ROOT, "ci", "matrix_table.py"))


@nox.session(python=False)
def sdists(session: nox.Session) -> None:
    """Fetch every supported release's sdist into the cache the other sessions read (``ci/sdists.py``)."""
    session.run(sys.executable, os.path.join(ROOT, "ci", "sdists.py"))


@nox.session
def sources(session: nox.Session) -> None:
    """The fingerprints and patches/ agree with the releases' own sdists (fetched first, into the cache), and
    ``status``, ``check`` and ``diff`` print on every release what ``tests/release/cli_golden`` recorded."""
    _install_torch(session, "torch==2.13.0")
    session.install("deepspeed==0.19.8", "packaging", "yapf==0.43.0", "wheel")
    session.install("pytest")
    session.install("--no-deps", "-e", ROOT)
    session.chdir(ROOT)
    session.run("python", os.path.join(ROOT, "ci", "sdists.py"))
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/release/test_sources.py")
    session.run("python", os.path.join(ROOT, "ci", "cli_golden.py"), "--check")


# The training stacks of tests/stacks, at the versions ci/constraints.txt pins (ci/pin.py says why transformers is
# held back).
STACK_LIBRARIES = ("transformers", "accelerate", "lightning")


@nox.session
@nox.parametrize("deepspeed", list(REPRESENTATIVE))
def stacks(session: nox.Session, deepspeed: str) -> None:
    """HF Trainer (``torchrun`` and the ``deepspeed`` launcher), Accelerate and Lightning, each launched as their
    users launch them, unpatched, under ``ds-offload-patch run`` and with a plain import (``tests/stacks``): no host
    sync in any boundary backward and bit-identical training; then the module with the patch disabled
    (``ci/check_red_green.py``: exactly its ``fails_unpatched`` tests must fail). Writes ``reports/layouts/stacks-<release>.json``. (CI runs it on 0.19.6, after its ``smoke``
    run, through ``ds-offload-patch run`` only and without the red/green run, which repeats the reference launches:
    ``nox -s ci-3.13 -- 0.19.6:smoke,no-diff,stacks-launcher``.)"""
    _install(session, deepspeed)
    _stacks(session, deepspeed)


def _stacks(session: nox.Session,
            deepspeed: str,
            routes: tuple = ("launcher", "import"),
            red_green: bool = True) -> None:
    """The training stacks (tests/stacks) patched through each of ``routes`` and unpatched, then (``red_green``) their
    red/green run; writes ``reports/layouts/stacks-<release>.json``. Without the red/green run (CI's cut) the
    reference tests still show each stack's unpatched launch syncing: that launch is what each patched test runs
    with the patch disabled, so the red/green run would repeat it."""
    os.makedirs(LAYOUTS, exist_ok=True)
    # A patched test's id ends with its route (hf-torchrun-launcher, hf-torchrun-import).
    left_out = [route for route in ("launcher", "import") if route not in routes]
    select = ["-k", " and ".join(f"not {route}" for route in left_out)] if left_out else []
    session.install(*STACK_LIBRARIES)
    _verify_pins(session)
    session.chdir(ROOT)
    measured = os.path.join(ROOT, "reports", "stacks", f"measured-{deepspeed}.json")  # what tests/stacks writes
    if os.path.exists(measured):
        os.remove(measured)
    # The launchers load DeepSpeed's shared-memory op from the release's own folder, built by _install.
    env = dict(CLEAN, DS_STACK_REPORT=measured)
    tests = _pytest(session, f"stacks-{deepspeed}", *select, "tests/stacks", env=env)
    with open(measured) as f:
        found = json.load(f)
    stacks = {name: _stack_sides(modes, routes) for name, modes in found["stacks"].items()}
    if not red_green:
        _finish_layout(session, "stacks", deepspeed, tests, None, {"versions": found["versions"], "stacks": stacks})
        return
    # Without the patch, exactly the tests marked fails_unpatched must fail (ci/check_red_green.py; the references
    # are left out, they are always unpatched). The module also holds a test that passes unpatched where a release
    # lacks the defect it checks (Accelerate over 4 micro-steps on 0.19.x), so "every test fails" is not the verdict.
    done, unpatched = _red_green(session,
                                 *select,
                                 "tests/stacks",
                                 env=dict(env, DS_STACK_REPORT=measured + ".unpatched"))
    more = {"versions": found["versions"], "stacks": stacks, "red_green": "pass" if done else "FAIL"}
    _finish_layout(session, "stacks", deepspeed, tests, unpatched, more)


def _stack_sides(modes: dict, routes: tuple) -> dict:
    """One stack's launches as the layouts table reads them: the reference is ``unpatched``; ``patched`` holds the
    launches through ``routes`` (``ds-offload-patch run``, a plain import; each rank's syncs per boundary backward,
    and each launch's wall time)."""
    sides = {"unpatched": ("reference", ), "patched": routes}
    return {
        side: {
            "boundary_syncs": [syncs for mode in names for syncs in modes[mode]["boundary_backward_syncs"].values()],
            "seconds": [modes[mode]["wall_s"] for mode in names],
        }
        for side, names in sides.items()
    }


@nox.session
def multinode(session: nox.Session) -> None:
    """Two nodes on one machine (``tests/multinode``: a real ``sshd``, DeepSpeed's pdsh runner, two ``torchrun``
    launchers with a c10d rendezvous; and 8 ranks, 2 nodes x 4, in 4 data-parallel x 2 model-parallel groups,
    ``test_eight_ranks.py``) on DeepSpeed 0.19.8 in a virtualenv of its own; then the modules with the patch
    disabled (``ci/check_red_green.py``: exactly their ``fails_unpatched`` tests must fail). Needs ``sshd`` and
    ``pdsh`` (``apt-get install openssh-server pdsh``); the tests fail, naming them, without. Writes
    ``reports/layouts/multinode-0.19.8.json``, the 8-rank runs among its configurations."""
    deepspeed = "0.19.8"
    os.makedirs(LAYOUTS, exist_ok=True)
    _install(session, deepspeed)
    session.chdir(ROOT)
    measured = os.path.join(ROOT, "reports", "multinode", f"measured-{deepspeed}.json")
    eight = os.path.join(ROOT, "reports", "multinode", f"eight-ranks-{deepspeed}.json")  # test_eight_ranks.py's
    os.makedirs(os.path.dirname(measured), exist_ok=True)
    for path in (measured, eight):
        if os.path.exists(path):
            os.remove(path)
    env = dict(CLEAN, DS_MULTINODE_REPORT=measured, DS_MULTINODE_EIGHT_REPORT=eight)
    tests = _pytest(session, f"multinode-{deepspeed}", "tests/multinode", env=env)
    # unpatched: check_red_green.py's own junit report, the module's tests with the patch disabled, the equivalence
    # ones left out.
    done, unpatched = _red_green(session, "tests/multinode", env=env)
    more = {}
    if os.path.exists(measured):
        with open(measured) as f:
            found = json.load(f)
        more = {"versions": found["versions"], "runs": found["runs"], "launches": found["launches"]}
    if os.path.exists(eight):  # the 8-rank runs, one configuration each, and their launches
        with open(eight) as f:
            found = json.load(f)
        more.setdefault("runs", {}).update(found["runs"])
        more.setdefault("launches", {}).update(found["launches"])
    # The module also holds tests that pass unpatched (a rank that cannot import the package): the verdict is
    # check_red_green.py's, exactly the marked tests failing.
    _finish_layout(session, "multinode", deepspeed, tests, unpatched, dict(more, red_green="pass" if done else "FAIL"))


@nox.session
def pipeline(session: nox.Session) -> None:
    """Pipeline parallelism (``tests/pipeline``): DeepSpeed's ``PipelineEngine`` over 2 stages x 2 data-parallel ranks,
    ZeRO-1 with offload, ``train_batch()``, bf16 and fp16 with a fault, and ``audit`` counting each ``train_batch()``,
    on DeepSpeed 0.19.8 in a virtualenv of its own; then the module with the patch disabled
    (``ci/check_red_green.py``: exactly its ``fails_unpatched`` tests must fail). Writes
    ``reports/layouts/pipeline-0.19.8.json`` with the host syncs per instruction (unpatched, patched)."""
    _layout_module(session, "pipeline")


@nox.session
def sequence(session: nox.Session) -> None:
    """Sequence parallelism (``tests/sequence``): DeepSpeed's Ulysses ``DistributedAttention`` over a sequence-parallel
    group of 2 ranks (gloo's all-to-all on the CPU), DeepSpeed's Ulysses ``mpu``, ZeRO-2 with offload, bf16 and fp16
    with a fault, on DeepSpeed 0.19.8 in a virtualenv of its own; then the module with the patch disabled
    (``ci/check_red_green.py``: exactly its ``fails_unpatched`` tests must fail). Writes
    ``reports/layouts/sequence-0.19.8.json`` with the host syncs per boundary backward (unpatched, patched)."""
    _layout_module(session, "sequence")


def _layout_module(session: nox.Session, kind: str, deepspeed: str = "0.19.8") -> None:
    """Run ``tests/<kind>`` on ``deepspeed`` in the session's own virtualenv, then its red/green run
    (``ci/check_red_green.py``), and write ``reports/layouts/<kind>-<release>.json`` with the runs the module measured
    (``reports/<kind>/<release>.json``, which its tests write)."""
    os.makedirs(LAYOUTS, exist_ok=True)
    _install(session, deepspeed)
    session.chdir(ROOT)
    measured = os.path.join(ROOT, "reports", kind, f"{deepspeed}.json")
    if os.path.exists(measured):
        os.remove(measured)
    env = dict(CLEAN)  # TORCH_EXTENSIONS_DIR: the release's own, where _install built DeepSpeed's shm op
    tests = _pytest(session, f"{kind}-{deepspeed}", f"tests/{kind}", env=env)
    # unpatched: check_red_green.py's own junit report, the module's tests with the patch disabled, the equivalence
    # ones left out (every one that ran is marked fails_unpatched, so the usual verdict applies; its own must agree).
    done, unpatched = _red_green(session, f"tests/{kind}", env=env)
    more = {}
    if os.path.exists(measured):
        with open(measured) as f:
            more["runs"] = json.load(f)["runs"]
    if not done:
        more["red_green"] = "FAIL"
    _finish_layout(session, kind, deepspeed, tests, unpatched, more)
