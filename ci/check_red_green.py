# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Red/green proof: with the patch disabled, the suite must fail exactly the tests that exist for the patch.

Runs, with ``DS_OFFLOAD_PATCH_DISABLE=1`` (junit XML under ``reports/``), every test module that holds a test marked
``fails_unpatched``, and compares the failing set with the marked tests. Tests marked ``equivalence`` are left out:
they run patched and unpatched processes of their own whatever the switch says (their own proof that they can fail
is a deliberately broken tracker, in ``test_offload_equivalence.py``). So are the modules without a marked test: they
test the package's other behaviour (the CLI, the switches, the lifecycle), nearly all in processes whose switches
they set themselves, so running them again would mostly repeat the green run (about 3 minutes of the 7 on 2 cores).
Exits 1 when a marked test passes without the patch (it cannot fail, so it proves nothing) or an unmarked test of
those modules fails without it. Extra arguments go to pytest: paths narrow the modules, the rest is passed on.

    python ci/check_red_green.py [pytest args...]
"""

import os
import runpy
import subprocess
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT = os.path.join(ROOT, "reports", "unpatched.xml")
# The switch's name, from the package's settings.py without importing the package (nothing here is patched).
DISABLE = runpy.run_path(os.path.join(ROOT, "deepspeed_offload_patch", "settings.py"))["DISABLE"]


def _case_id(classname: str, name: str) -> str:
    """junit's ``classname`` + ``name`` as a pytest node id, ``path.py::Class::test[param]``."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = os.path.join(*parts[:cut]) + ".py"
        if os.path.exists(os.path.join(ROOT, path)):
            return "::".join([path] + parts[cut:] + [name])
    return f"{classname}::{name}"


def marked_tests(pytest_args) -> set:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "fails_unpatched"] +
                         pytest_args,
                         cwd=ROOT,
                         capture_output=True,
                         text=True,
                         check=True).stdout
    return {line.strip() for line in out.splitlines() if "::" in line}


def _modules(expected: set, pytest_args) -> list:
    """``pytest_args`` with its paths replaced by the modules that hold the marked tests ``expected``."""
    options = [arg for arg in pytest_args if not os.path.exists(os.path.join(ROOT, arg.split("::")[0]))]
    return options + sorted({test.split("::")[0] for test in expected})


def unpatched_results(pytest_args) -> dict:
    """Run ``pytest_args`` with the patch disabled; return {node id: passed, failed or skipped}."""
    os.makedirs(os.path.dirname(REPORT), exist_ok=True)
    env = dict(os.environ, **{DISABLE: "1"})
    # Equivalence tests set each of their processes' switches themselves: the outer switch does not change them,
    # so running them again here would only repeat the green run.
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not equivalence", f"--junitxml={REPORT}"] +
                   pytest_args,
                   cwd=ROOT,
                   env=env,
                   check=False)
    results = {}
    for case in ET.parse(REPORT).getroot().iter("testcase"):
        outcome = "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        results[_case_id(case.get("classname"), case.get("name"))] = outcome
    return results


def main(pytest_args) -> int:
    expected = marked_tests(pytest_args)
    results = unpatched_results(_modules(expected, pytest_args))
    failed = {test for test, outcome in results.items() if outcome == "failed"}
    problems = []
    if not expected:
        problems.append("no test is marked fails_unpatched")
    for test in sorted(expected - failed):
        problems.append(f"passes without the patch, so it cannot show the patch works: {test} "
                        f"({results.get(test, 'not run')})")
    for test in sorted(failed - expected):
        problems.append(f"fails without the patch but is not marked fails_unpatched: {test}")
    skipped = sorted(test for test, outcome in results.items() if outcome == "skipped")
    for test in skipped:
        problems.append(f"skipped without the patch: {test}")

    print(f"\nwith {DISABLE}=1: {len(failed)} failed of {len(results)}; "
          f"{len(expected)} are expected to fail")
    for test in sorted(expected):
        print(f"  {'red (as expected)' if test in failed else 'GREEN (wrong)':<18} {test}")
    for problem in problems:
        print(f"FAIL: {problem}")
    if not problems:
        print("red/green: OK, the suite fails exactly the tests that exist for the patch")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
