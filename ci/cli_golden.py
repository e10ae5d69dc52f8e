# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""What ``status``, ``status --json``, ``check`` and ``diff`` print on each DeepSpeed release, recorded and compared.

For each release, DeepSpeed's own source (its sdist, from ``ci/sdists.py``'s cache, extracted) goes first on
``PYTHONPATH`` of a fresh interpreter, with this checkout's package and the environment's torch; that interpreter runs
each command through ``cli.main`` and records its stdout, the lines the command itself writes to stderr (``diff``'s
file name and errors) and its exit code. Each release runs with the default switches; the releases in
:data:`SWITCHED` also run under each switch of :data:`SCENARIOS`. The Python version, the environment's prefix and the
extraction folder are written as ``<python>``, ``<prefix>`` and ``<src>``: everything else is byte for byte.

The record is ``tests/release/cli_golden/<release>.txt``: a restructure of the package must leave it unchanged unless a
wording changes on purpose (then ``--write`` and the diff in the same commit).

    python ci/cli_golden.py --check                 # every release; exit 1 and a diff when one prints otherwise
    python ci/cli_golden.py --check 0.16.9 0.19.8   # those releases
    python ci/cli_golden.py --write                 # record what this checkout prints
"""

import argparse
import difflib
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "ci"))
from sdists import DEFAULT_CACHE, prefetch, sdist_path  # noqa: E402

GOLDEN = os.path.join(ROOT, "tests", "release", "cli_golden")
#: The commands recorded, in order (each a ``ds-offload-patch`` argument list); the diffs in the default scenario only
#: (the switches change what is applied, not which diff goes with the release).
COMMANDS = (("status", ), ("status", "--json"), ("check", ))
DIFFS = (("diff", ), ("diff", "--grad-norm"), ("diff", "--skipped-step"))
#: Environments beside the default one (switch settings), run on :data:`SWITCHED`.
SCENARIOS = {
    "upstream-only": {
        "DS_OFFLOAD_PATCH_UPSTREAM_ONLY": "1"
    },
    "grad-norm-off": {
        "DS_OFFLOAD_PATCH_GRAD_NORM": "0"
    },
    "skipped-step-off": {
        "DS_OFFLOAD_PATCH_SKIPPED_STEP": "0"
    },
    "disabled": {
        "DS_OFFLOAD_PATCH_DISABLE": "1"
    },
    "auto-off": {
        "DS_OFFLOAD_PATCH_AUTO": "0"
    },
    "strict": {
        "DS_OFFLOAD_PATCH_STRICT": "1"
    },
}
#: One release of each form of the methods (0.14.0 - 0.17.0, 0.17.x, 0.18.0 - 0.19.6, 0.19.7 on), the first of all
#: (which does not import with the current torch), and the last.
SWITCHED = ("0.14.0", "0.16.9", "0.17.1", "0.19.6", "0.19.8")

# Run in the fresh interpreter: each command in turn, in one process (the package's state is decided once, as a
# user's process decides it). DeepSpeed's own log lines go to the real stderr and are not recorded.
_CHILD = r"""
import contextlib, io, json, sys
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        from deepspeed_offload_patch.cli import main
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    own = [line for line in err.getvalue().splitlines() if line.startswith(("# ", "ds-offload-patch"))]
    results.append({"argv": argv, "code": code, "stdout": out.getvalue(), "stderr": own})
print("\n@@RESULTS@@" + json.dumps(results))
"""


def _extract(release: str, cache: str, into: str) -> str:
    """Extract the ``deepspeed`` package of ``release``'s sdist under ``into``; returns the folder to put on the path."""
    top = os.path.join(into, release)
    prefix = f"deepspeed-{release}/deepspeed/"
    with tarfile.open(sdist_path(cache, release)) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        tar.extractall(top, members=members, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(
            top, members=members)
    return os.path.join(top, f"deepspeed-{release}")


def record(release: str, cache: str, scratch: str, switched: Tuple[str, ...] = SWITCHED) -> str:
    """The text recorded for ``release``: every scenario's commands, normalized (see the module's docstring); the
    scenarios of :data:`SCENARIOS` only when ``release`` is in ``switched``."""
    src = _extract(release, cache, scratch)
    scenarios = {"default": {}}
    if release in switched:
        scenarios.update(SCENARIOS)
    parts = []
    for name, switches in scenarios.items():
        env = {k: v for k, v in os.environ.items() if not k.startswith("DS_OFFLOAD_PATCH_") or k.endswith("SDISTS")}
        env.update(switches, PYTHONPATH=os.pathsep.join([src, ROOT]), PYTHONHASHSEED="0")
        commands = COMMANDS + (DIFFS if name == "default" else ())
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps([list(c) for c in commands])],
            cwd=scratch,
            env=env,
            capture_output=True,
            text=True)
        _, marker, payload = proc.stdout.rpartition("\n@@RESULTS@@")
        if proc.returncode != 0 or not marker:
            raise RuntimeError(f"{release} ({name}): the commands did not run (exit {proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        for result in json.loads(payload):
            parts.append(f"### {name}: ds-offload-patch {' '.join(result['argv'])} (exit {result['code']})\n")
            parts.append(result["stdout"])
            parts.extend(f"stderr: {line}\n" for line in result["stderr"])
    text = "".join(parts)
    # Paths and the interpreter's version are the machine's, not the package's: a failing import names them.
    return text.replace(src, "<src>").replace(sys.prefix, "<prefix>").replace(platform.python_version(), "<python>")


def _default_only(text: str) -> str:
    """The default scenario's part of a record."""
    return "".join(section for section in _sections(text) if section.startswith("### default: "))


def _sections(text: str) -> List[str]:
    """A record cut at each ``### `` header line."""
    sections: List[str] = []
    for line in text.splitlines(True):
        if line.startswith("### ") or not sections:
            sections.append("")
        sections[-1] += line
    return sections


def compare(release: str, text: str, golden: str = GOLDEN, default_only: bool = False) -> Optional[str]:
    """None when ``text`` is the recorded one (``default_only``: the record's default scenario, for a release run
    without the others), else a unified diff (recorded -> now)."""
    path = os.path.join(golden, f"{release}.txt")
    if not os.path.exists(path):
        return f"{path}: no record (python ci/cli_golden.py --write {release})"
    with open(path) as f:
        recorded = f.read()
    if default_only:
        recorded = _default_only(recorded)
    if recorded == text:
        return None
    return "".join(
        difflib.unified_diff(recorded.splitlines(True), text.splitlines(True), f"{release} recorded",
                             f"{release} now"))


def run(releases: List[str], cache: str, write: bool, jobs: int, golden: str = GOLDEN, quick: bool = False) -> int:
    """Record (``write``) or compare every release; returns the exit code (1 when one differs). ``quick``: the
    switches' scenarios on the last of ``releases`` only."""
    switched = tuple(releases[-1:]) if quick else SWITCHED
    prefetch(cache, releases)
    with tempfile.TemporaryDirectory(prefix="cli-golden-") as scratch:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            texts: Dict[str, str] = dict(
                zip(releases, pool.map(lambda release: record(release, cache, scratch, switched), releases)))
    failed: List[Tuple[str, str]] = []
    for release, text in texts.items():
        if write:
            os.makedirs(golden, exist_ok=True)
            with open(os.path.join(golden, f"{release}.txt"), "w") as f:
                f.write(text)
            print(f"cli_golden: {release}: written")
            continue
        problem = compare(release, text, golden, default_only=release in SWITCHED and release not in switched)
        print(f"cli_golden: {release}: {'same' if problem is None else 'DIFFERS'}")
        if problem is not None:
            failed.append((release, problem))
    for release, problem in failed:
        print(problem)
    return 1 if failed else 0


def main() -> int:
    sys.path.insert(0, ROOT)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--check", action="store_true", help="compare with the record; exit 1 when one differs")
    which.add_argument("--write", action="store_true", help="record what this checkout prints")
    parser.add_argument("--quick",
                        action="store_true",
                        help="with --check: the switches' scenarios on the last release given only")
    parser.add_argument("--sdists", default=DEFAULT_CACHE, help="the sdist cache (default: %(default)s)")
    parser.add_argument("--golden", default=GOLDEN, help="the folder of the records (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=2, help="releases run at once (default 2)")
    parser.add_argument("releases", nargs="*", help="releases (default: every supported one)")
    args = parser.parse_args()
    if args.write and args.quick:
        parser.error("--quick compares only part of a record; write the whole")
    from deepspeed_offload_patch.releases import PATCHED_RELEASES
    return run(args.releases or list(PATCHED_RELEASES), args.sdists, args.write, args.jobs, args.golden, args.quick)


if __name__ == "__main__":
    sys.exit(main())
