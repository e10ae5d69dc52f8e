# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""``ci/matrix_table.py``: rewriting ci/README.md's tables keeps the rows of releases and builds that did not run
again, and a layout or stack session passes only with every test passed and its red/green run held."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "ci"))

import matrix_table  # noqa: E402

OLD = """| DeepSpeed | built from | state on import | tests | red/green | fix / grad norm | diffs alone | result | commit |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
| 0.14.1 | PyPI, torch 2.3.1 | applied | 19/19 passed | – | upstream-fixed / unsupported | 19/19 passed | pass | a |
| 0.16.9 | PyPI | applied | 97/97 passed | pass | upstream-fixed / unsupported | 19/19 passed | pass | a |
| 0.19.9 | 0.19.8 sdist, 0.19.9 | applied | 8/8 passed | – | – | – | pass | a |
| 0.20.0.dev0 | 0.19.8 sdist, 0.20.0.dev0 | applied | 137/137 passed | – | – | – | pass | a |
"""


def test_rows_that_did_not_run_again_are_kept():
    kept = [row for _, row in matrix_table.kept_rows(OLD, {"0.16.9@3.11", "0.19.8 sdist, 0.19.9@3.11"})]
    assert [row.split("|")[1].strip() for row in kept] == ["0.14.1", "0.20.0.dev0"], kept
    # The rows written before the Python column ran on 3.11: they gain it.
    assert all(row.split("|")[3].strip() == "3.11" for row in kept), kept


def test_a_row_is_its_release_and_its_python():
    old = matrix_table.render([
        dict(release="0.16.9", python="3.11.7", **RESULT),
        dict(release="0.16.9", python="3.13.0", **RESULT),
        dict(release="0.19.8", python="3.10.13", package="wheel", **RESULT),
    ])
    # 0.16.9 ran again on 3.13 only; the wheel's run on 3.10 is its own row, kept beside 0.16.9's.
    kept = [row for _, row in matrix_table.kept_rows(old, {"0.16.9@3.13"})]
    assert [(row.split("|")[1].strip(), row.split("|")[3].strip()) for row in kept] == [("0.16.9", "3.11"),
                                                                                        ("0.19.8", "3.10")], kept
    assert "the package's wheel" in kept[1]


RESULT = {"state": "applied", "expected": "applied", "tests": {"passed": 3, "failed": 0, "skipped": 0}, "commit": "a"}


def _layout(failed=0, red_green="pass"):
    sides = {
        "unpatched": {
            "boundary_syncs": [[6, 6], [6, 7]],
            "seconds": [1.0, 2.0]
        },
        "patched": {
            "boundary_syncs": [[0, 0], [0, 0]],
            "seconds": [1.0, 1.5]
        }
    }
    return {
        "kind": "scale",
        "release": "0.16.9",
        "tests": {
            "passed": 3,
            "failed": failed,
            "skipped": 0
        },
        "red_green": red_green,
        "runs": {
            "2dp-2mp": sides
        },
        "commit": "a"
    }


def test_a_layout_session_passes_only_with_its_red_green_run():
    assert matrix_table.layout_passed(_layout())
    assert not matrix_table.layout_passed(_layout(failed=1))
    assert not matrix_table.layout_passed(_layout(red_green="FAIL"))
    row = matrix_table.render_layouts([_layout()]).splitlines()[-1]
    assert "| scale | 3.11 | 3/3 passed | pass | 2dp-2mp 7 → 0 (2 s) |" in row and row.endswith("| pass | a |"), row


def test_the_states_table_groups_releases_and_flags_a_wrong_state():

    def changes(skipped_step, expected):
        return dict(changes={
            "skipped_step": skipped_step,
            "grad_norm_on_device": "off"
        },
                    changes_expected={
                        "skipped_step": expected,
                        "grad_norm_on_device": "off"
                    })

    release = dict(state="applied", expected="applied", torch="2.13.0", **changes("not-needed", "not-needed"))
    found = {
        "python": "3.11.7",
        "commit": "a",
        "not_on_cpu": ["0.14.0"],
        "releases": {
            "0.19.6": release,
            "0.19.7": release,
            "0.19.8": dict(release, **changes("applied", "applied")),
            "0.19.9": dict(release, **changes("not-needed", "applied")),
        }
    }
    rows = [line.split("|")[1:-1] for line in matrix_table.render_states(found).splitlines() if line[:3] == "| 0"]
    assert [(row[0].strip(), row[4].strip(), row[-1].strip())
            for row in rows] == [("0.19.6 – 0.19.7", "not-needed", "yes"), ("0.19.8", "applied", "yes"),
                                 ("0.19.9", "not-needed", "NO")]
