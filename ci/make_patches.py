# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Write ``patches/``: the change as unified diffs of ``deepspeed/runtime/zero/stage_1_and_2.py``, one per form.

For each patch set (the fix in ``patches/``, the grad norm in ``patches/grad-norm-on-device/``, the skipped-step
fix in ``patches/skipped-step-buffer/``) and each supported release, it replaces the set's methods in the release's
own file (from its sdist) with this package's replacements for that form, and diffs. Consecutive releases share a diff when the first one's diff
applies to them with ``git apply`` and gives exactly their patched file. It writes the diffs, ``index.json``
(release -> diff) and ``README.md``. ``--check`` writes nothing and exits 1 when ``patches/`` differs from what the
sources give, when a diff does not apply to one of its releases, when a patched file's methods are not equal
(AST) to the package's replacements, or when they use a global name that the release's module does not define (the
replacements run in the package's module, with its imports; in DeepSpeed's file they have only that file's, so AST
equality alone would not show that the diffed file runs).

    python ci/make_patches.py [--sdists CACHE] [--check]
"""

import argparse
import ast
import builtins
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

from packaging.specifiers import SpecifierSet  # noqa: E402
from packaging.version import Version  # noqa: E402

from gen_fingerprints import TARGET, method_sources, read_target  # noqa: E402
from deepspeed_offload_patch import guard, settings  # noqa: E402
from deepspeed_offload_patch.releases import PATCHED_RELEASES  # noqa: E402
from sdists import DEFAULT_CACHE, sdist_path  # noqa: E402

PATCHES = os.path.join(ROOT, "patches")


def replacements_for(source: str, patch_set) -> dict:
    """The replacement for each of ``patch_set``'s methods in ``source``'s ``DeepSpeedZeroOptimizer``, by form."""
    chosen = {}
    for name, text in method_sources(source, patch_set.methods).items():
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


def replace_methods(source: str, texts: dict) -> str:
    """``source`` (a ``stage_1_and_2.py``) with the methods of ``DeepSpeedZeroOptimizer`` named in ``texts``
    replaced by their texts (indented as methods)."""
    lines = source.splitlines(keepends=True)
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "DeepSpeedZeroOptimizer")
    spans = [(min([n.lineno] + [d.lineno for d in n.decorator_list]), n.end_lineno, n.name) for n in cls.body
             if isinstance(n, ast.FunctionDef) and n.name in texts]
    for first, last, name in sorted(spans, reverse=True):
        lines[first - 1:last] = [texts[name]]
    return "".join(lines)


def patched(source: str, patch_set) -> str:
    """``source`` (a release's ``stage_1_and_2.py``) with ``patch_set``'s methods replaced."""
    chosen = replacements_for(source, patch_set)
    return replace_methods(source, {name: method_text(name, func) for name, func in chosen.items()})


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


def methods_equal_replacements(original: str, patched_source: str, patch_set) -> bool:
    """The patched file's methods equal (AST, names aside) the package's replacements for the original's form."""
    chosen = {name: guard.fingerprint(func) for name, func in replacements_for(original, patch_set).items()}
    found = {
        name: guard.fingerprint_source(text)
        for name, text in method_sources(patched_source, patch_set.methods).items()
    }
    return found == chosen


def _bound(node: ast.AST) -> set:
    """The names ``node`` binds anywhere inside it: arguments, assignments, imports, loop and ``with`` targets,
    nested functions and classes, ``except ... as``."""
    names = set()
    for child in ast.walk(node):
        if isinstance(child, ast.arg):
            names.add(child.arg)
        elif isinstance(child, ast.Name) and isinstance(child.ctx, (ast.Store, ast.Del)):
            names.add(child.id)
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(child.name)
        elif isinstance(child, ast.alias):
            names.add((child.asname or child.name).split(".")[0])
        elif isinstance(child, ast.ExceptHandler) and child.name:
            names.add(child.name)
    return names


def unresolved_globals(patched_source: str, methods) -> dict:
    """For each of ``methods`` of ``DeepSpeedZeroOptimizer`` in ``patched_source``: the names it reads that neither
    it binds nor the module defines at its top level nor Python builtins (names a run of that file would miss)."""
    tree = ast.parse(patched_source)
    module = set(dir(builtins))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            module.add(node.name)
        else:
            module |= _bound(node)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DeepSpeedZeroOptimizer")
    found = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name in methods:
            local = _bound(node)
            loads = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            missing = sorted(loads - local - module)
            if missing:
                found[node.name] = missing
    return found


def build(sdists: str, patch_set):
    """The diffs (file name -> text) and the index (release -> file name) of ``patch_set``."""
    diffs, index, current = {}, {}, None
    for version in releases_of(patch_set):
        source = read_target(sdist_path(sdists, version), version)
        after = patched(source, patch_set)
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


def _prefix(root: str, where: str) -> str:
    """How README.md links into ``where``: "" for the root, ``name/`` for a subfolder."""
    relative = os.path.relpath(where, root)
    return "" if relative == "." else f"{relative}/"


def releases_of(patch_set) -> list:
    """The supported releases whose methods have ``patch_set``'s names."""
    return [v for v in PATCHED_RELEASES if SpecifierSet(patch_set.releases).contains(v)]


def folder(root: str, patch_set) -> str:
    return root if patch_set in guard.FIX_FORMS else os.path.join(root, patch_set.name)


def readme(indexes: dict) -> str:
    """``indexes``: the index (release -> diff) of each folder, the fix's first."""
    sections = []
    for prefix, index in indexes.items():
        groups = {}
        for version, name in index.items():
            groups.setdefault(name, []).append(version)
        rows = "\n".join(
            f"| [`{prefix}{name}`]({prefix}{name}) | "
            f"{versions[0]} – {versions[-1]} ({len(versions)} release{'' if len(versions) == 1 else 's'}) |"
            for name, versions in groups.items())
        sections.append(f"| diff | DeepSpeed releases |\n| --- | --- |\n{rows}")
    return f"""# The change as unified diffs

For a DeepSpeed fork or checkout: the same change the package makes at import time, as a diff of
`{TARGET}`. Generated by `ci/make_patches.py` from each release's own file; CI checks that each diff applies
cleanly to every release listed for it and that the patched methods equal the package's replacements (AST).

The fix, what the package applies by default: `update_offload_overflow_tracker` and `has_overflow` from DeepSpeed
0.17.1, `update_overflow_tracker_for_param_grad` and `has_overflow` in 0.14.0 – 0.17.0:

{sections[0]}

The on-device gradient norm (`complete_grad_norm_calculation_for_cpu_offload`; on by default,
`{settings.GRAD_NORM}=0` leaves it out), in `grad-norm-on-device/`: `step()` sums the gradient norms on the
device instead of reading one per parameter tensor. It touches another method than the fix, so it applies with or
without the fix's diff:

{sections[1]}

The skipped-step fix (`reset_cpu_buffers`; on by default where DeepSpeed has the defect, which came with 0.19.8's
compact fp32 gradient buffer: after a step skipped for an inf/NaN, the buffer is dropped instead of carrying the
inf/NaN into every later step), in `skipped-step-buffer/`. It touches another method than the fix, so it applies with
or without the fix's diff:

{sections[2]}

Apply a diff at the top of a DeepSpeed checkout of a listed release:

```bash
git apply /path/to/patches/stage_1_and_2-0.19.7-0.19.8.diff     # or: patch -p1 < /path/to/....diff
```

`ds-offload-patch diff` prints the fix's diff for the installed release (`--grad-norm` the grad norm's,
`--skipped-step` the skipped-step fix's). With a diff
applied, the package reports that part as `upstream-fixed` and patches nothing there. `index.json` in each folder
maps each release to its diff.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdists", default=DEFAULT_CACHE, help="the sdist cache (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="verify patches/, write nothing")
    parser.add_argument("--patches", default=PATCHES, help="the folder to check or write (default: patches/)")
    args = parser.parse_args()
    os.makedirs(args.sdists, exist_ok=True)
    problems, files, indexes, count = [], {}, {}, 0
    for patch_set in guard.PATCH_SETS:
        diffs, index = build(args.sdists, patch_set)
        where = folder(args.patches, patch_set)
        merged = {**indexes.get(_prefix(args.patches, where), {}), **index}
        indexes[_prefix(args.patches, where)] = dict(sorted(merged.items(), key=lambda item: Version(item[0])))
        count += len(diffs)
        files.update({os.path.join(where, name): text for name, text in diffs.items()})
        files[os.path.join(where, "index.json")] = json.dumps(indexes[_prefix(args.patches, where)], indent=2) + "\n"
        for version, name in index.items():
            original = read_target(sdist_path(args.sdists, version), version)
            after = git_apply(diffs[name], original)
            if after is None:
                problems.append(f"{name} does not apply to {version}")
            elif not methods_equal_replacements(original, after, patch_set):
                problems.append(f"{name} on {version}: the patched methods differ from the package's replacements")
            else:
                unresolved = unresolved_globals(after, patch_set.methods)
                if unresolved:
                    problems.append(f"{name} on {version}: the patched methods use names the release's module does "
                                    f"not define: {unresolved}")
    files[os.path.join(args.patches, "README.md")] = readme(indexes)

    if args.check:
        for path, text in files.items():
            if not os.path.exists(path) or open(path).read() != text:
                problems.append(f"{path} is out of date: run ci/make_patches.py")
        for where in {os.path.dirname(path) for path in files}:
            for name in sorted(os.listdir(where)) if os.path.isdir(where) else ():
                path = os.path.join(where, name)
                if os.path.isfile(path) and path not in files:
                    problems.append(f"{path} is not generated by ci/make_patches.py")
    else:
        for path, text in files.items():
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
    for problem in problems:
        print(f"FAIL: {problem}")
    if not problems:
        print(f"patches/: {count} diffs for {len(PATCHED_RELEASES)} releases; each applies to its releases and "
              f"equals the package's replacements")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
