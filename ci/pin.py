# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The environment the tests run in, pinned: ``ci/constraints.txt``.

    python ci/pin.py                 # resolve TEST_ENVIRONMENT on every supported Python, write ci/constraints.txt
    python ci/pin.py --verify        # exit 1 if an installed package differs from its pin for this Python

``ci/setup.sh`` (the checkout's ``.venv``), ``ci/package.sh``, every nox session (the matrix, the training stacks) and
``tests/release/test_pythons.py`` install with this file as pip's constraints file, so a release published upstream
(DeepSpeed, torch, pytest, transformers, ...) changes nothing in the tests until this command is run on purpose and
its result committed. The package's own requirements (``setup.py``) stay open ranges, and the upstream watch
(``ci/upstream_watch.py``) keeps trying the newest DeepSpeed. A nox session installs the DeepSpeed and torch it
tests, and whatever it names beside them (0.14.1 - 0.14.3 run on numpy 1): :func:`without` leaves those out of its copy.

Resolving runs ``pip install --dry-run --report`` once per supported Python (ci/pythons.py finds them): a package whose
newest installable version differs between Pythons gets one line per version, with a ``python_version`` marker.
Fails (exit 1) if an interpreter is missing or pip cannot resolve the set on it.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, Iterable, List, Optional

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONSTRAINTS = os.path.join(HERE, "constraints.txt")

# What the tests install, by name; the versions come from the resolution, except where a pin says why.
TEST_ENVIRONMENT = (
    "torch==2.13.0",  # the one torch CI runs (its CPU build where TORCH_INDEX_URL points at it)
    "deepspeed",
    f"{ROOT}[dev]",  # the package's dev tools (setup.py): pytest, yapf, flake8, codespell, nox, sybil, ...
    # The training stacks (tests/stacks), on the Pythons their transformers supports (nox runs them on 3.13 in CI).
    # transformers 5.25.0 needs kernels>=0.19.1, which the registry does not serve: 5.23.0 is the newest that installs.
    'transformers==5.23.0; python_version >= "3.11"',
    'accelerate; python_version >= "3.11"',
    'lightning; python_version >= "3.11"',
)
OURS = "deepspeed-offload-patch"


def resolve(python: str) -> Dict[str, str]:
    """{canonical name: version} of what pip would install for :data:`TEST_ENVIRONMENT` on ``python``, from nothing.
    Raises ``RuntimeError`` with pip's output when it cannot resolve."""
    index = os.environ.get("TORCH_INDEX_URL")
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        command = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", report]
        command += ["--extra-index-url", index] if index else []
        done = subprocess.run(command + list(TEST_ENVIRONMENT), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{python}: pip could not resolve the test environment:\n{done.stdout}{done.stderr}")
        with open(report) as f:
            found = json.load(f)["install"]
    versions = {}
    for item in found:
        name = canonicalize_name(item["metadata"]["name"])
        if name != OURS:
            versions[name] = item["metadata"]["version"].split("+")[0]  # torch's +cpu: the pin matches either build
    return versions


def render(by_python: Dict[str, Dict[str, str]]) -> str:
    """The constraints file for ``{python version: resolve(...)}``: one line per package, or one per version with a
    ``python_version`` marker where the Pythons differ (a package some Pythons do not install is pinned for the others
    only)."""
    pythons = sorted(by_python, key=lambda v: tuple(map(int, v.split("."))))
    names = sorted(set().union(*by_python.values()))
    lines = [
        f"# Written by `python ci/pin.py` on {datetime.date.today().isoformat()} for Python {', '.join(pythons)}: the versions the",
        "# tests install (pip constraints; ci/pin.py says who uses it and how to update it). Not the package's requirements.",
    ]
    for name in names:
        versions: Dict[str, List[str]] = {}
        for python in pythons:
            if name in by_python[python]:
                versions.setdefault(by_python[python][name], []).append(python)
        if len(versions) == 1 and sum(map(len, versions.values())) == len(pythons):
            lines.append(f"{name}=={next(iter(versions))}")
            continue
        for version, on in versions.items():
            marker = " or ".join(f'python_version == "{python}"' for python in on)
            lines.append(f"{name}=={version}; {marker}")
    return "\n".join(lines) + "\n"


def pins(text: str, environment: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """{canonical name: pinned version} of the lines of ``text`` that apply to ``environment`` (this interpreter's by
    default). Raises ``ValueError`` on a line that is not an exact pin."""
    found = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        specs = list(requirement.specifier)
        if len(specs) != 1 or specs[0].operator != "==":
            raise ValueError(f"not an exact pin: {line}")
        if requirement.marker is None or requirement.marker.evaluate(environment or default_environment()):
            found[canonicalize_name(requirement.name)] = specs[0].version
    return found


def without(text: str, names: Iterable[str]) -> str:
    """``text`` without the lines that pin any of ``names`` (a session installs those at versions of its own: a
    constraint that disagreed with them would make pip's resolution fail)."""
    free = {canonicalize_name(Requirement(name).name) for name in names}
    kept = []
    for line in text.splitlines():
        body = line.split("#", 1)[0].strip()
        if body and canonicalize_name(Requirement(body).name) in free:
            continue
        kept.append(line)
    return "\n".join(kept) + "\n"


def mismatches(text: str) -> List[str]:
    """The installed distributions whose version differs from their pin in ``text`` for this interpreter, one line
    each (``name: installed X, pinned Y``); a pinned package that is not installed is not a mismatch."""
    import importlib.metadata

    wanted = pins(text)
    found = []
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"] or "")
        version = dist.version.split("+")[0]
        if name in wanted and version != wanted[name]:
            found.append(f"{name}: installed {dist.version}, pinned {wanted[name]}")
    return sorted(found)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verify", action="store_true", help="compare this interpreter's packages with the pins")
    parser.add_argument("--constraints", default=CONSTRAINTS, help="the file to verify against (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.verify:
        with open(args.constraints) as f:
            wrong = mismatches(f.read())
        for line in wrong:
            print(f"ci/pin.py: {line}", file=sys.stderr)
        return 1 if wrong else 0
    sys.path.insert(0, HERE)
    from pythons import SUPPORTED, find

    by_python = {}
    for version in SUPPORTED:
        python = find(version)
        if not python:
            print(f"ci/pin.py: no Python {version} here (ci/pythons.py)", file=sys.stderr)
            return 1
        print(f"resolving on Python {version} ({python})", file=sys.stderr)
        try:
            by_python[version] = resolve(python)
        except RuntimeError as exc:
            print(f"ci/pin.py: {exc}", file=sys.stderr)
            return 1
    with open(CONSTRAINTS, "w") as f:
        f.write(render(by_python))
    print(f"wrote {os.path.relpath(CONSTRAINTS, ROOT)}: {len(set().union(*by_python.values()))} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
