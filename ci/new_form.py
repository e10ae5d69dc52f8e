# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The runbook's second step: what changed in the installed DeepSpeed's methods, against the forms the package knows.

Run in an environment where that DeepSpeed is installed. For each method a patch set replaces, it prints the guard's
finding, the method's fingerprint and, for a form the package does not know, the known release whose method is
closest (by text, from the sdists' cache: ``ci/sdists.py``) with a unified diff from it. That diff is what a new
replacement in the change's ``methods.py`` (``deepspeed_offload_patch/changes/<name>/``) has to answer.

    python ci/new_form.py [--sdists CACHE]
"""

import argparse
import difflib
import importlib
import inspect
import os
import runpy
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# DeepSpeed's own methods are what is read here: the import of the package below must not patch them. The switch's
# name comes from the package's settings.py, read without importing the package (that import must see the switch).
os.environ[runpy.run_path(os.path.join(ROOT, "deepspeed_offload_patch", "settings.py"))["DISABLE"]] = "1"
sys.path.insert(0, os.path.join(ROOT, "ci"))

from gen_fingerprints import method_sources, read_target  # noqa: E402
from sdists import DEFAULT_CACHE, sdist_path  # noqa: E402

from deepspeed_offload_patch import guard  # noqa: E402
from deepspeed_offload_patch.changes import CHANGES  # noqa: E402
from deepspeed_offload_patch.fingerprints import UNFIXED  # noqa: E402

KNOWN = ("patchable", "fixed", "ours")


def known_sources(sdists: str, change, name: str) -> dict:
    """``{release: source}`` of ``change``'s method ``name``: the last release of each known unfixed form."""
    found = {}
    target = change.target
    for releases in UNFIXED.get(change.key(name), {}).values():
        release = releases[-1]
        source = method_sources(read_target(sdist_path(sdists, release), release, target.path),
                                names=(name, ),
                                class_name=target.name).get(name)
        if source:
            found[release] = textwrap.dedent(source)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdists", default=DEFAULT_CACHE, help="the sdist cache (default: %(default)s)")
    args = parser.parse_args()
    import deepspeed
    print(f"DeepSpeed {deepspeed.__version__}")
    new = 0
    for change, name in [(change, name) for change in CHANGES for name in change.method_names]:
        cls = getattr(importlib.import_module(change.target.module), change.target.name)
        key = change.key(name)
        if name not in cls.__dict__:
            print(f"{key}: not defined here")
            continue
        finding, _ = guard.classify_method(cls, name, change)
        digest = guard.fingerprint(cls.__dict__[name])
        known = UNFIXED.get(key, {}).get(digest)
        print(f"{key}: {finding}, fingerprint {digest}" +
              (f" (the form of {known[0]} - {known[-1]})" if known else ""))
        if finding in KNOWN:
            continue
        new += 1
        source = textwrap.dedent(inspect.getsource(guard.unwrapped(cls.__dict__[name])))
        candidates = known_sources(args.sdists, change, name)
        if not candidates:
            print(source)
            continue
        release, closest = max(candidates.items(),
                               key=lambda item: difflib.SequenceMatcher(None, item[1], source).ratio())
        print("".join(
            difflib.unified_diff(closest.splitlines(keepends=True),
                                 source.splitlines(keepends=True),
                                 fromfile=f"{name} in DeepSpeed {release}",
                                 tofile=f"{name} in DeepSpeed {deepspeed.__version__}")))
    print(f"{new} method(s) in a form the package does not know")
    return 0


if __name__ == "__main__":
    sys.exit(main())
