# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Print the DeepSpeed matrix's last results (``reports/matrix/*.json``, written by ``ci/noxfile.py``) as a table.

    python ci/matrix_table.py             # print
    python ci/matrix_table.py --readme    # also write it into ci/README.md between the matrix markers
    python ci/matrix_table.py --require RELEASE [RELEASE ...]   # exit 1 unless these have a passing result
                                                                 # (a variant build by its kind: truth-test, ...)
"""

import argparse
import glob
import json
import os
import sys

from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORTS = os.path.join(ROOT, "reports", "matrix")
START, END = "<!-- matrix:start -->", "<!-- matrix:end -->"


def load() -> list:
    results = []
    for path in glob.glob(os.path.join(REPORTS, "*.json")):
        with open(path) as f:
            results.append(json.load(f))
    return sorted(results, key=lambda r: (Version(r["release"]), r.get("variant", "")))


def passed(result: dict) -> bool:
    """The state is the expected one, the tests ran and none failed or was skipped, the red/green proof (where it
    ran) held, and with the diffs applied both parts read as expected and the ZeRO tests passed on the diffs alone."""
    tests = result["tests"]
    ok = result["state"] == result["expected"] and tests["failed"] == 0 and tests["skipped"] == 0 and tests["passed"]
    ok = ok and result.get("red_green", "pass") == "pass"
    ok = ok and result.get("watch", {}).get("as_expected", True)
    if "diff_tests" in result:
        ok = (ok and result["diff_state"] == "upstream-fixed"
              and result.get("diff_grad_norm_state") == result.get("diff_grad_norm_expected", "upstream-fixed")
              and result["diff_tests"]["failed"] == 0)
    return bool(ok)


def _tests(counts: dict) -> str:
    total = counts["passed"] + counts["failed"] + counts["skipped"]
    return f"{counts['passed']}/{total} passed"


def kept_rows(old_table: str, rerun: set) -> list:
    """Rows of the previous table for PyPI releases that did not run again, in the current columns (a row of the
    older 7-column layout gains "PyPI" and "–"). A release that was unsupported then is dropped: it is tested now."""
    rows = []
    for line in old_table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 7 or not cells[0][:1].isdigit() or cells[0] in rerun:
            continue
        if len(cells) == 7:
            if cells[1] == "unsupported":
                continue
            cells = [cells[0], "PyPI", cells[1], cells[2], "–", *cells[3:]]
        if cells[1] == "PyPI":
            rows.append((Version(cells[0]), "| " + " | ".join(cells) + " |"))
    return rows


def render(results: list, kept: list = ()) -> str:
    lines = [
        "| DeepSpeed | built from | state on import | tests | red/green | fix / grad norm with the diffs applied "
        "| ZeRO tests on the diffs alone | result | commit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = []
    for r in results:
        diff_state = f"{r['diff_state']} / {r.get('diff_grad_norm_state', '?')}" if "diff_state" in r else "–"
        diff_tests = _tests(r["diff_tests"]) if "diff_tests" in r else "–"
        built = r.get("variant", "PyPI")
        if r.get("torch", "2.13.0").split("+")[0] != "2.13.0":
            built += f", torch {r['torch'].split('+')[0]}"
        rows.append((Version(r["release"]), f"| {r['release']} | {built} | {r['state']} | {_tests(r['tests'])} | "
                     f"{r.get('red_green', '–')} | {diff_state} | {diff_tests} | {'pass' if passed(r) else 'FAIL'} | "
                     f"{r.get('commit', '?')} |"))
    lines += [line for _, line in sorted(list(kept) + rows, key=lambda row: row[0])]
    return "\n".join(lines) + "\n"


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
    args = parser.parse_args()
    results = load()
    table = render(results)
    print(table)
    if args.readme:
        path = os.path.join(ROOT, "ci", "README.md")
        with open(path) as f:
            text = f.read()
        head, rest = text.split(START, 1)
        old, tail = rest.split(END, 1)
        table = render(results, kept_rows(old, {r["release"] for r in results if "variant" not in r}))
        with open(path, "w") as f:
            f.write(f"{head}{START}\n{table}{END}{tail}")
    # A release by its version; a variant build by its kind (the last part of "0.19.8 sdist, <kind>").
    by_release = {r["variant"].split(", ")[-1] if "variant" in r else r["release"]: r for r in results}
    missing = [v for v in args.require if v not in by_release or not passed(by_release[v])]
    failing = [r["release"] for r in results if not passed(r)]
    for release in sorted(set(missing) | set(failing), key=_order):
        print(f"FAIL: DeepSpeed {release}: no passing result")
    return 1 if missing or failing else 0


if __name__ == "__main__":
    sys.exit(main())
