# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Write ``patches/``: the change as unified diffs of ``deepspeed/runtime/zero/stage_1_and_2.py``, one per form.

For each supported release it replaces the two methods in the release's own file (from its sdist) with this
package's replacements for that form, and diffs. Consecutive releases share a diff when the first one's diff
applies to them with ``git apply`` and gives exactly their patched file. It writes the diffs, ``index.json``
(release -> diff) and ``README.md``. ``--check`` writes nothing and exits 1 when ``patches/`` differs from what the
sources give, when a diff does not apply to one of its releases, or when a patched file's methods are not equal
(AST) to the package's replacements.

    python ci/make_patches.py --sdists ~/.cache/ds-offload-patch/sdists [--check]
"""

import argparse
import ast
import difflib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "ci"))

from gen_fingerprints import TARGET, method_sources, read_target, sdist_path  # noqa: E402
from deepspeed_offload_patch import guard  # noqa: E402
from deepspeed_offload_patch.releases import PATCHED_RELEASES  # noqa: E402

PATCHES = os.path.join(ROOT, "patches")


def replacements_for(source: str) -> dict:
    """The replacement function for each method of ``source``'s ``DeepSpeedZeroOptimizer``, by its form."""
    chosen = {}
    for name, text in method_sources(source).items():
        func = guard.replacement_for(name, guard.fingerprint_source(text))
        if func is None:
            raise SystemExit(f"{name}: a form with no replacement; regenerate the fingerprints first")
        chosen[name] = func
    return chosen


def method_text(name: str, func) -> str:
    """``func``'s source as method ``name`` of the class: renamed, indented one level."""
    lines = textwrap.dedent(inspect.getsource(func)).splitlines(keepends=True)
    lines[0] = lines[0].replace(f"def {func.__name__}(", f"def {name}(", 1)
    return textwrap.indent("".join(lines), "    ")


def patched(source: str) -> str:
    """``source`` (a release's ``stage_1_and_2.py``) with both methods replaced."""
    lines = source.splitlines(keepends=True)
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "DeepSpeedZeroOptimizer")
    chosen = replacements_for(source)
    spans = [(min([n.lineno] + [d.lineno for d in n.decorator_list]), n.end_lineno, n.name) for n in cls.body
             if isinstance(n, ast.FunctionDef) and n.name in chosen]
    for first, last, name in sorted(spans, reverse=True):
        lines[first - 1:last] = [method_text(name, chosen[name])]
    return "".join(lines)


def unified_diff(before: str, after: str) -> str:
    return "".join(
        difflib.unified_diff(before.splitlines(keepends=True),
                             after.splitlines(keepends=True),
                             fromfile=f"a/{TARGET}",
                             tofile=f"b/{TARGET}"))


def git_apply(diff: str, source: str):
    """``source`` after ``git apply`` of ``diff`` in a scratch tree, or None when it does not apply cleanly."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, TARGET)
        os.makedirs(os.path.dirname(path))
        with open(path, "w") as f:
            f.write(source)
        with open(os.path.join(tmp, "change.diff"), "w") as f:
            f.write(diff)
        done = subprocess.run(["git", "apply", "--whitespace=nowarn", "change.diff"], cwd=tmp, capture_output=True)
        if done.returncode != 0:
            return None
        with open(path) as f:
            return f.read()


def methods_equal_replacements(patched_source: str) -> bool:
    """The patched file's two methods equal (AST, names aside) the package's replacements for that form."""
    chosen = {name: guard.fingerprint(func) for name, func in replacements_for_patched(patched_source).items()}
    found = {name: guard.fingerprint_source(text) for name, text in method_sources(patched_source).items()}
    return found == chosen


def replacements_for_patched(patched_source: str) -> dict:
    """The replacements the patched methods should equal: matched by fingerprint among all replacements."""
    result = {}
    for name, text in method_sources(patched_source).items():
        digest = guard.fingerprint_source(text)
        for _, func in guard._replacements(name):
            if guard.fingerprint(func) == digest:
                result[name] = func
        result.setdefault(name, None)
    return result


def build(sdists: str):
    """The diffs (file name -> text) and the index (release -> file name)."""
    diffs, index, current = {}, {}, None
    for version in PATCHED_RELEASES:
        source = read_target(sdist_path(sdists, version), version)
        after = patched(source)
        if current is not None and git_apply(diffs[current], source) == after:
            index[version] = current
            continue
        current = version
        diffs[current] = unified_diff(source, after)
        index[version] = current
    names = {}
    for first in diffs:
        last = [v for v, d in index.items() if d == first][-1]
        names[first] = f"stage_1_and_2-{first}-{last}.diff" if last != first else f"stage_1_and_2-{first}.diff"
    return {names[f]: text for f, text in diffs.items()}, {v: names[f] for v, f in index.items()}


def readme(index: dict) -> str:
    groups = {}
    for version, name in index.items():
        groups.setdefault(name, []).append(version)
    rows = "\n".join(f"| [`{name}`]({name}) | {versions[0]} – {versions[-1]} ({len(versions)} releases) |"
                     for name, versions in groups.items())
    return f"""# The change as unified diffs

For a DeepSpeed fork or checkout: the same change the package makes at import time, as a diff of
`{TARGET}`. Generated by `ci/make_patches.py` from each release's own file; CI checks that each diff applies
cleanly to every release listed for it and that the patched methods equal the package's replacements (AST).

| diff | DeepSpeed releases |
| --- | --- |
{rows}

Apply it at the top of a DeepSpeed checkout of a listed release:

```bash
git apply /path/to/patches/stage_1_and_2-0.18.0-0.19.8.diff     # or: patch -p1 < /path/to/....diff
```

`ds-offload-patch diff` prints the diff for the installed release. With the diff applied, the package reports
`upstream-fixed` and patches nothing. `index.json` maps each release to its diff.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdists", default=os.path.expanduser("~/.cache/ds-offload-patch/sdists"))
    parser.add_argument("--check", action="store_true", help="verify patches/, write nothing")
    parser.add_argument("--patches", default=PATCHES, help="the folder to check or write (default: patches/)")
    args = parser.parse_args()
    os.makedirs(args.sdists, exist_ok=True)
    diffs, index = build(args.sdists)
    files = dict(diffs)
    files["index.json"] = json.dumps(index, indent=2) + "\n"
    files["README.md"] = readme(index)

    problems = []
    for version, name in index.items():
        after = git_apply(diffs[name], read_target(sdist_path(args.sdists, version), version))
        if after is None:
            problems.append(f"{name} does not apply to {version}")
        elif not methods_equal_replacements(after):
            problems.append(f"{name} on {version}: the patched methods differ from the package's replacements")
    if args.check:
        for name, text in files.items():
            path = os.path.join(args.patches, name)
            if not os.path.exists(path) or open(path).read() != text:
                problems.append(f"{path} is out of date: run ci/make_patches.py")
        extra = set(os.listdir(args.patches)) - set(files) if os.path.isdir(args.patches) else set()
        problems.extend(f"{name} in {args.patches} is not generated by ci/make_patches.py" for name in sorted(extra))
    else:
        os.makedirs(args.patches, exist_ok=True)
        for name, text in files.items():
            with open(os.path.join(args.patches, name), "w") as f:
                f.write(text)
    for problem in problems:
        print(f"FAIL: {problem}")
    if not problems:
        print(f"patches/: {len(diffs)} diffs for {len(index)} releases; each applies to its releases and equals "
              f"the package's replacements")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
