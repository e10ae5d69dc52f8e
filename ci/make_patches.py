# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Write ``patches/``: each change as unified diffs of its class's file (``deepspeed/runtime/zero/stage_1_and_2.py``,
``stage3.py``, ``precision_config.py``), one per form.

For each change of ``deepspeed_offload_patch.changes`` (in ``patches/<its name>/``) and each supported release of its
forms, it replaces the change's methods in the release's own file (from its sdist) with this package's replacements
for that form (or, for a change that sets a default, writes the new default), and diffs. Consecutive releases share a
diff when the first one's diff applies to them with ``git apply`` and gives exactly their patched file. It writes the diffs, ``index.json``
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

from packaging.version import Version  # noqa: E402

from gen_fingerprints import TARGET, method_sources, read_target  # noqa: E402
from deepspeed_offload_patch import guard  # noqa: E402
from deepspeed_offload_patch.changes import CHANGES, UPSTREAM  # noqa: E402
from deepspeed_offload_patch.releases import PATCHED_RELEASES  # noqa: E402
from sdists import DEFAULT_CACHE, sdist_path  # noqa: E402

PATCHES = os.path.join(ROOT, "patches")


def replacements_for(source: str, change, version: str) -> dict:
    """The replacement for each of ``change``'s methods in ``source``'s ``DeepSpeedZeroOptimizer`` (release
    ``version``), by form."""
    chosen = {}
    for name, text in method_sources(source, change.form_of(version).methods, change.target.name).items():
        func = guard.replacement_for(change, name, guard.fingerprint_source(text))
        if func is None:
            raise SystemExit(f"{name}: a form with no replacement; regenerate the fingerprints first")
        chosen[name] = func
    return chosen


def method_text(name: str, func) -> str:
    """``func``'s source as method ``name`` of the class: renamed, indented one level."""
    lines = textwrap.dedent(inspect.getsource(func)).splitlines(keepends=True)
    lines[0] = lines[0].replace(f"def {func.__name__}(", f"def {name}(", 1)
    return textwrap.indent("".join(lines), "    ")


def replace_methods(source: str, texts: dict, class_name: str = UPSTREAM.target.name) -> str:
    """``source`` (a ``stage_1_and_2.py``, or the file of ``class_name``) with the methods of ``class_name`` named in
    ``texts`` replaced by their texts (indented as methods); DeepSpeed's decorators of a method stay (ZeRO-3's NVTX
    ranges: the package puts them on its replacement too)."""
    lines = source.splitlines(keepends=True)
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == class_name)
    spans = [(n.lineno, n.end_lineno, n.name) for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in texts]
    for first, last, name in sorted(spans, reverse=True):
        lines[first - 1:last] = [texts[name]]
    return "".join(lines)


def default_node(source: str, change) -> ast.expr:
    """The default value's node of the field that ``change`` (one with a ``default``) sets, in its class in
    ``source``."""
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == change.target.name)
    return next(
        n.value for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == change.default.field)


def with_default(source: str, change) -> str:
    """``source`` with the default of ``change``'s field written as ``change.default.value``."""
    node = default_node(source, change)
    lines = source.splitlines(keepends=True)
    line = lines[node.lineno - 1]
    lines[node.lineno - 1] = line[:node.col_offset] + repr(change.default.value) + line[node.end_col_offset:]
    return "".join(lines)


def patched(source: str, change, version: str) -> str:
    """``source`` (release ``version``'s file of ``change``'s class) with ``change``'s methods replaced (or its
    default set)."""
    if change.default is not None:
        return with_default(source, change)
    chosen = replacements_for(source, change, version)
    return replace_methods(source, {
        name: method_text(name, func)
        for name, func in chosen.items()
    }, change.target.name)


def unified_diff(before: str, after: str, target: str = TARGET) -> str:
    return "".join(
        difflib.unified_diff(before.splitlines(keepends=True),
                             after.splitlines(keepends=True),
                             fromfile=f"a/{target}",
                             tofile=f"b/{target}"))


def git_apply(diff: str, source: str, target: str = TARGET):
    """``source`` (DeepSpeed's file ``target``) after ``git apply`` of ``diff`` in a scratch tree, or None when it
    does not apply cleanly."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, target)
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


def methods_equal_replacements(original: str, patched_source: str, change, version: str) -> bool:
    """The patched file's methods equal (AST, names aside) the package's replacements for the original's form."""
    chosen = {name: guard.fingerprint(func) for name, func in replacements_for(original, change, version).items()}
    found = {
        name: guard.fingerprint_source(text)
        for name, text in method_sources(patched_source,
                                         change.form_of(version).methods, change.target.name).items()
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


def top_level_names(source: str) -> set:
    """The names a module's top level binds (defined, assigned or imported), star imports aside."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        else:
            names |= _bound(node)
    return names - {"*"}


def star_imported(read, source: str, seen=None) -> set:
    """The public names ``source``'s ``from deepspeed... import *`` lines bring in, following theirs in turn;
    ``read(module_path)`` gives the text of a file of the same release (``deepspeed/runtime/zero/stage3.py``'s
    ``torch`` and ``instrument_w_nvtx`` come from ``partition_parameters``)."""
    seen = set() if seen is None else seen
    names = set()
    for node in ast.parse(source).body:
        if (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("deepspeed")
                and any(alias.name == "*" for alias in node.names) and node.module not in seen):
            seen.add(node.module)
            text = read(node.module.replace(".", "/") + ".py")
            names |= {name for name in top_level_names(text) if not name.startswith("_")}
            names |= star_imported(read, text, seen)
    return names


def unresolved_globals(patched_source: str, methods, class_name: str = UPSTREAM.target.name, star=()) -> dict:
    """For each of ``methods`` of ``class_name`` in ``patched_source``: the names it reads that neither it binds nor
    the module defines at its top level (or brings in with a star import: ``star``) nor Python builtins (names a run
    of that file would miss)."""
    tree = ast.parse(patched_source)
    module = set(dir(builtins)) | set(star)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            module.add(node.name)
        else:
            module |= _bound(node)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    found = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name in methods:
            local = _bound(node)
            loads = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            missing = sorted(loads - local - module)
            if missing:
                found[node.name] = missing
    return found


def build(sdists: str, change):
    """The diffs (file name -> text) and the index (release -> file name) of ``change``."""
    diffs, index, current = {}, {}, None
    target, stem = change.target.path, change.target.stem
    for version in releases_of(change):
        source = read_target(sdist_path(sdists, version), version, target)
        after = patched(source, change, version)
        if current is not None and git_apply(diffs[current], source, target) == after:
            index[version] = current
            continue
        current = version
        diffs[current] = unified_diff(source, after, target)
        index[version] = current
    names = {}
    for first in diffs:
        last = [v for v, d in index.items() if d == first][-1]
        names[first] = f"{stem}-{first}-{last}.diff" if last != first else f"{stem}-{first}.diff"
    return {names[f]: text for f, text in diffs.items()}, {v: names[f] for v, f in index.items()}


def releases_of(change) -> list:
    """The supported releases that have one of ``change``'s forms (or its unfixed default)."""
    return [v for v in PATCHED_RELEASES if change.covers(v)]


def _forms_text(change) -> str:
    """```a` and `b` in 0.17.1 – 0.19.8; ...``: the methods of each form and their releases, newest first (forms
    with the same methods, which differ in their code, read as one range); for a default, the field's."""
    if change.default is not None:
        versions = releases_of(change)
        return (f"`{change.target.name}.{change.default.field}`'s default ({change.default.unfixed!r} in "
                f"{versions[0]} – {versions[-1]}, {change.default.value!r} with the diff)")
    releases = {}
    for version in PATCHED_RELEASES:
        form = change.form_of(version)
        if form is not None:
            releases.setdefault(form.methods, []).append(version)
    parts = []
    for methods, versions in reversed(list(releases.items())):
        span = versions[0] if len(versions) == 1 else f"{versions[0]} – {versions[-1]}"
        parts.append(f"{' and '.join(f'`{name}`' for name in methods)} in {span}")
    return "; ".join(parts)


def table(index: dict, prefix: str) -> str:
    """The diffs of one folder and their releases, as a Markdown table."""
    groups = {}
    for version, name in index.items():
        groups.setdefault(name, []).append(version)
    rows = "\n".join(f"| [`{prefix}{name}`]({prefix}{name}) | " +
                     (f"{versions[0]} (1 release) |" if len(versions) ==
                      1 else f"{versions[0]} – {versions[-1]} ({len(versions)} releases) |")
                     for name, versions in groups.items())
    return f"| diff | DeepSpeed releases |\n| --- | --- |\n{rows}"


def readme(indexes: dict) -> str:
    """``indexes``: each change's index (release -> diff), by change name."""
    sections = []
    for change in CHANGES:
        default = (f"off by default (opt-in: {change.opt_in}), `{change.switch}=1` turns it on"
                   if change.opt_in else f"on by default, `{change.switch}=0` leaves it out")
        switch = "" if change.upstream else f"; {default}, and it applies with or without the other diffs"
        where = "" if change.target == UPSTREAM.target else f" (a diff of `{change.target.path}`)"
        sections.append(
            f"### `{change.name}/`: {change.title}{where}\n\n{_forms_text(change)}{switch}: {change.about}\n\n"
            f"{table(indexes[change.name], change.name + '/')}")
    body = "\n\n".join(sections)
    flags = ", ".join(f"`--{change.name}` {change.title}'s" for change in CHANGES if not change.upstream)
    example = f"{UPSTREAM.name}/" + indexes[UPSTREAM.name][PATCHED_RELEASES[-1]]
    return f"""# The change as unified diffs

For a DeepSpeed fork or checkout: the same changes the package makes at import time, as diffs of
`{TARGET}` (and of another file where a change says so), one folder per change. Generated by `ci/make_patches.py` from each release's own file; CI checks that each
diff applies cleanly to every release listed for it and that the patched methods equal the package's replacements
(AST).

{body}

Apply a diff at the top of a DeepSpeed checkout of a listed release:

```bash
git apply /path/to/patches/{example}     # or: patch -p1 < /path/to/....diff
```

`ds-offload-patch diff` prints {UPSTREAM.title}'s diff for the installed release ({flags}). With a diff
applied, the package reports that change as `upstream-fixed` and patches nothing there. `index.json` in each folder
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
    for change in CHANGES:
        diffs, index = build(args.sdists, change)
        where = os.path.join(args.patches, change.name)
        indexes[change.name] = dict(sorted(index.items(), key=lambda item: Version(item[0])))
        count += len(diffs)
        files.update({os.path.join(where, name): text for name, text in diffs.items()})
        files[os.path.join(where, "index.json")] = json.dumps(indexes[change.name], indent=2) + "\n"
        for version, name in index.items():
            original = read_target(sdist_path(args.sdists, version), version, change.target.path)
            after = git_apply(diffs[name], original, change.target.path)
            if after is None:
                problems.append(f"{name} does not apply to {version}")
            elif change.default is not None:
                if ast.literal_eval(default_node(after, change)) != change.default.value:
                    problems.append(f"{name} on {version}: {change.default.field} does not default to "
                                    f"{change.default.value!r}")
            elif not methods_equal_replacements(original, after, change, version):
                problems.append(f"{name} on {version}: the patched methods differ from the package's replacements")
            else:
                star = star_imported(lambda path: read_target(sdist_path(args.sdists, version), version, path), after)
                unresolved = unresolved_globals(after, change.form_of(version).methods, change.target.name, star)
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
