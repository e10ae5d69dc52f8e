# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Print the DeepSpeed matrix's last results (``reports/matrix/*.json``, written by ``ci/noxfile.py``) as a table,
those of the layout and stack sessions (``reports/layouts/*.json``: ``scale`` and ``stacks``) as a second one, and the
``states`` session's (``reports/states.json``: each change's state on every release) as a third.

    python ci/matrix_table.py             # print
    python ci/matrix_table.py --readme    # also write them into ci/README.md between their markers
    python ci/matrix_table.py --require RELEASE [RELEASE ...]   # exit 1 unless these have a passing result
                                                                 # (a variant build by its kind: truth-test, ...;
                                                                 # RELEASE@3.13: the result on that Python)
    python ci/matrix_table.py --require-layouts stacks-0.19.8    # the same for layout/stack sessions (@3.13 too)
"""

import argparse
import glob
import json
import os
import sys

from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from deepspeed_offload_patch.changes import OTHERS, UPSTREAM  # noqa: E402
from deepspeed_offload_patch.states import State  # noqa: E402

REPORTS = os.path.join(ROOT, "reports", "matrix")
START, END = "<!-- matrix:start -->", "<!-- matrix:end -->"
LAYOUTS = os.path.join(ROOT, "reports", "layouts")
LAYOUTS_START, LAYOUTS_END = "<!-- layouts:start -->", "<!-- layouts:end -->"
STATES = os.path.join(ROOT, "reports", "states.json")
STATES_START, STATES_END = "<!-- states:start -->", "<!-- states:end -->"


def load() -> list:
    results = []
    for path in glob.glob(os.path.join(REPORTS, "*.json")):
        with open(path) as f:
            results.append(json.load(f))
    return sorted(results, key=lambda r: (Version(r["release"]), r.get("variant", "")))


def passed(result: dict) -> bool:
    """Every change's state is the expected one, the tests ran and none failed or was skipped, the red/green proof
    (where it ran) held, and with the diffs applied every change reads as expected and the ZeRO tests passed on the
    diffs alone."""
    tests = result["tests"]
    ok = result["state"] == result["expected"] and tests["failed"] == 0 and tests["skipped"] == 0 and tests["passed"]
    ok = ok and result.get("changes") == result.get("changes_expected")
    ok = ok and result.get("red_green", "pass") == "pass"
    ok = ok and result.get("watch", {}).get("as_expected", True)
    if "diff_tests" in result:
        ok = (ok and result["diff_state"] == State.UPSTREAM_FIXED
              and result.get("diff_changes") == result.get("diff_changes_expected")
              and result["diff_tests"]["failed"] == 0)
    return bool(ok)


def _tests(counts: dict) -> str:
    total = counts["passed"] + counts["failed"] + counts["skipped"]
    return f"{counts['passed']}/{total} passed"


#: "built from" of a row where the package ran from its wheel in a fresh virtualenv (the ``pythons`` session).
WHEEL = ", the package's wheel"


def python_of(result: dict) -> str:
    """The Python a result ran on, as ``X.Y`` (results written before the column existed ran on 3.11)."""
    return ".".join(result.get("python", "3.11").split(".")[:2])


def row_key(result: dict) -> str:
    """What makes a row: a PyPI release by its version, a variant by what it was built from; the Python; and
    ``:wheel`` for a run of the package's wheel (the ``pythons`` session)."""
    wheel = ":wheel" if result.get("package") == "wheel" else ""
    return f"{result.get('variant', result['release'])}@{python_of(result)}{wheel}"


def kept_rows(old_table: str, rerun: set) -> list:
    """Rows of the previous table for releases and variant builds that did not run again (``rerun`` holds
    :func:`row_key` of each new result), in the current columns (a row of the older 7-column layout gains "PyPI" and
    "–", one of the 9-column layouts the Python they ran on, 3.11). A release that was unsupported then is dropped: it
    is tested now."""
    rows = []
    for line in old_table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 7 or not cells[0][:1].isdigit():
            continue
        if len(cells) == 7:
            if cells[1] == State.UNSUPPORTED:
                continue
            cells = [cells[0], "PyPI", cells[1], cells[2], "–", *cells[3:]]
        if len(cells) == 9:
            cells = [cells[0], cells[1], "3.11", *cells[2:]]
        # A PyPI row (on torch 2.13.0, or "PyPI, torch 2.3.1") by its release; a variant's by what it was built from.
        key = (cells[0] if cells[1].startswith("PyPI") else cells[1]) + "@" + cells[2]
        key += ":wheel" if cells[1].endswith(WHEEL) else ""
        if key not in rerun:
            rows.append((Version(cells[0]), "| " + " | ".join(cells) + " |"))
    return rows


def render(results: list, kept: list = ()) -> str:
    lines = [
        "| DeepSpeed | built from | Python | state on import | tests | red/green | each change with the diffs "
        "applied | ZeRO tests on the diffs alone | result | commit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = []
    for r in results:
        diff_state = (" / ".join([r["diff_state"], *r.get("diff_changes", {}).values()]) if "diff_state" in r else "–")
        diff_tests = _tests(r["diff_tests"]) if "diff_tests" in r else "–"
        built = r.get("variant", "PyPI")
        built += WHEEL if r.get("package") == "wheel" else ""
        if r.get("torch", "2.13.0").split("+")[0] != "2.13.0":
            built += f", torch {r['torch'].split('+')[0]}"
        state = r["state"] + "".join(f"; {change.label} {r['changes'][change.state_key]}"
                                     for change in OTHERS if change.state_key in r.get("changes", {}))
        rows.append((Version(r["release"]), f"| {r['release']} | {built} | {python_of(r)} | {state} | "
                     f"{_tests(r['tests'])} | "
                     f"{r.get('red_green', '–')} | {diff_state} | {diff_tests} | {'pass' if passed(r) else 'FAIL'} | "
                     f"{r.get('commit', '?')} |"))
    lines += [line for _, line in sorted(list(kept) + rows, key=lambda row: row[0])]
    return "\n".join(lines) + "\n"


def load_layouts() -> list:
    results = []
    for path in glob.glob(os.path.join(LAYOUTS, "*.json")):
        with open(path) as f:
            results.append(json.load(f))
    return sorted(results, key=lambda r: (r["kind"], Version(r["release"])))


def layout_passed(result: dict) -> bool:
    """The tests ran and none failed or was skipped; for ``scale``, the zero-sync tests failed without the patch."""
    tests = result["tests"]
    ok = tests["failed"] == 0 and tests["skipped"] == 0 and tests["passed"] > 0
    return bool(ok and result.get("red_green", "pass") == "pass")


def _syncs(configs: dict) -> str:
    """``name: unpatched → patched`` per configuration: the most host syncs of any boundary backward of any rank."""
    parts = []
    for name, sides in configs.items():
        most = {side: max(max(rank) for rank in found["boundary_syncs"]) for side, found in sides.items()}
        seconds = max(max(found["seconds"]) for found in sides.values())
        parts.append(f"{name} {most['unpatched']} → {most['patched']} ({seconds:.0f} s)")
    return "; ".join(parts)


def render_layouts(results: list) -> str:
    lines = [
        "| DeepSpeed | session | Python | tests | red/green | host syncs per boundary backward and rank, unpatched → "
        "patched (slowest rank's time per configuration and side) | versions | result | commit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        versions = ", ".join(f"{k} {v}" for k, v in r.get("versions", {}).items() if k not in ("deepspeed", ))
        configs = r.get("runs", r.get("stacks", {}))
        lines.append(f"| {r['release']} | {r['kind']} | {python_of(r)} | {_tests(r['tests'])} | "
                     f"{r.get('red_green', '–')} | "
                     f"{_syncs(configs) or '–'} | {versions or '–'} | "
                     f"{'pass' if layout_passed(r) else 'FAIL'} | {r.get('commit', '?')} |")
    return "\n".join(lines) + "\n"


def states_as_expected(r: dict) -> bool:
    """One release's states (``nox -s states``) are the expected ones, every change's."""
    return r["state"] == r["expected"] and r.get("changes") == r.get("changes_expected")


def render_states(found: dict) -> str:
    """Consecutive releases with the same states (and torch) as one row: ``first – last``."""
    rows = []
    for version, r in sorted(found["releases"].items(), key=lambda item: Version(item[0])):
        ok = states_as_expected(r)
        key = (r["state"], *(r["changes"].get(change.state_key) for change in OTHERS), r["torch"], ok)
        if rows and rows[-1][0] == key:
            rows[-1][1].append(version)
        else:
            rows.append((key, [version]))
    lines = [
        f"Python {found['python']}, commit {found['commit']}; not run on the CPU: {', '.join(found['not_on_cpu'])} "
        "(its methods are 0.14.1's: the fingerprints).", "",
        "| DeepSpeed | releases | torch | " + " | ".join(change.title
                                                         for change in (UPSTREAM, ) + OTHERS) + " | as expected |",
        "| --- | --- | --- | " + "--- | " * len(OTHERS) + "--- | --- |"
    ]
    for (state, *others, torch, ok), versions in rows:
        span = versions[0] if len(versions) == 1 else f"{versions[0]} – {versions[-1]}"
        lines.append(f"| {span} | {len(versions)} | {torch} | {state} | " + " | ".join(map(str, others)) +
                     f" | {'yes' if ok else 'NO'} |")
    return "\n".join(lines) + "\n"


def _write_between(path: str, start: str, end: str, table: str) -> None:
    with open(path) as f:
        text = f.read()
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w") as f:
        f.write(f"{head}{start}\n{table}{end}{tail}")


def _order(name: str):
    """Releases by version, variant kinds (``truth-test``, ...) after them by name."""
    try:
        return (0, Version(name), "")
    except ValueError:
        return (1, Version("0"), name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", action="store_true", help="write the table into ci/README.md")
    parser.add_argument("--require", nargs="*", default=[], help="releases that must have a passing result")
    parser.add_argument(
        "--require-layouts",
        nargs="*",
        default=[],
        metavar="SESSION-RELEASE",
        help="layout/stack sessions that must have a passing result (scale-0.16.9, stacks-0.19.8, ...)")
    args = parser.parse_args()
    results = load()
    table = render(results)
    print(table)
    layouts = load_layouts()
    print(render_layouts(layouts))
    if os.path.exists(STATES):
        with open(STATES) as f:
            print(render_states(json.load(f)))
    if args.readme:
        path = os.path.join(ROOT, "ci", "README.md")
        with open(path) as f:
            old = f.read().split(START, 1)[1].split(END, 1)[0]
        rerun = {row_key(r) for r in results}
        table = render(results, kept_rows(old, rerun))
        _write_between(path, START, END, table)
        _write_between(path, LAYOUTS_START, LAYOUTS_END, render_layouts(layouts))
        if os.path.exists(STATES):
            with open(STATES) as f:
                _write_between(path, STATES_START, STATES_END, render_states(json.load(f)))
    # A release by its version; a variant build by its kind (the last part of "0.19.8 sdist, <kind>"); either with
    # "@X.Y" for the result on that Python.
    by_release = {}
    for r in results:
        name = r["variant"].split(", ")[-1] if "variant" in r else r["release"]
        if r.get("package") != "wheel":
            by_release[name] = r
        by_release[f"{name}@{python_of(r)}"] = r
    missing = [v for v in args.require if v not in by_release or not passed(by_release[v])]
    failing = [r["release"] for r in results if not passed(r)]
    for release in sorted(set(missing) | set(failing), key=_order):
        print(f"FAIL: DeepSpeed {release}: no passing result")
    by_session = {}
    for r in layouts:
        by_session[f"{r['kind']}-{r['release']}"] = r
        by_session[f"{r['kind']}-{r['release']}@{python_of(r)}"] = r
    missing_layouts = [s for s in args.require_layouts if s not in by_session or not layout_passed(by_session[s])]
    failing_layouts = [f"{r['kind']}-{r['release']}@{python_of(r)}" for r in layouts if not layout_passed(r)]
    for name in sorted(set(missing_layouts) | set(failing_layouts)):
        print(f"FAIL: {name}: no passing result")
    return 1 if missing or failing or missing_layouts or failing_layouts else 0


if __name__ == "__main__":
    sys.exit(main())
