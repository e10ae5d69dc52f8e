# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The pinned test environment (``ci/constraints.txt``, written by ``ci/pin.py``): this checkout's venv has exactly the
pinned versions, every install of ``ci/setup.sh`` and ``ci/package.sh`` is constrained by the file, and the helpers
nox uses read, filter and write it as they say."""

import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "ci"))

import pin  # noqa: E402


def _constraints(path: str = pin.CONSTRAINTS) -> str:
    with open(path) as f:
        return f.read()


def _installed_with() -> str:
    """The pins this environment was installed with: ci/constraints.txt, or in a nox session its copy."""
    return os.environ.get("PIP_CONSTRAINT", pin.CONSTRAINTS)


def test_this_venv_has_the_pinned_versions() -> None:
    """What ci/setup.sh installed equals the pins for this Python, DeepSpeed and torch among them; in a nox session,
    what it installed equals the pins it installed with (``PIP_CONSTRAINT``: the file less its own DeepSpeed and
    torch)."""
    path = _installed_with()
    text = _constraints(path)
    wanted = pin.pins(text)
    assert {"pytest", "sybil", "packaging"} <= set(wanted), sorted(wanted)
    if path == pin.CONSTRAINTS:
        assert {"deepspeed", "torch"} <= set(wanted), sorted(wanted)
    assert pin.mismatches(text) == []


def test_a_version_that_differs_from_its_pin_is_reported() -> None:
    import importlib.metadata

    installed = importlib.metadata.version("pytest")
    text = _constraints(_installed_with()).replace(f"pytest=={installed}", "pytest==0.0.1")
    assert pin.mismatches(text) == [f"pytest: installed {installed}, pinned 0.0.1"]


def test_render_pins_once_or_per_python_and_pins_reads_it_back() -> None:
    text = pin.render({
        "3.10": {
            "numpy": "2.2.6",
            "pytest": "9.2.0",
            "tomli": "2.3.0"
        },
        "3.13": {
            "numpy": "2.5.5",
            "pytest": "9.2.0"
        },
    })
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert lines == [
        'numpy==2.2.6; python_version == "3.10"',
        'numpy==2.5.5; python_version == "3.13"',
        "pytest==9.2.0",
        'tomli==2.3.0; python_version == "3.10"',
    ]
    assert pin.pins(text, {"python_version": "3.10"}) == {"numpy": "2.2.6", "pytest": "9.2.0", "tomli": "2.3.0"}
    assert pin.pins(text, {"python_version": "3.13"}) == {"numpy": "2.5.5", "pytest": "9.2.0"}


def test_pins_refuses_a_line_that_is_not_an_exact_pin() -> None:
    with pytest.raises(ValueError, match="not an exact pin: numpy<2"):
        pin.pins("numpy<2\n")


def test_without_leaves_out_what_a_session_installs_at_its_own_version() -> None:
    """nox installs each release's DeepSpeed, its torch and (for 0.14.1 - 0.14.3) numpy 1: a pin of those would make
    pip's resolution fail, so its copy of the file has none of them, and every other pin."""
    text = _constraints()
    kept = pin.without(text, ("deepspeed", "torch==2.3.1", "numpy<2"))
    names = set(pin.pins(kept))
    assert not names & {"deepspeed", "torch", "numpy"}
    assert names == set(pin.pins(text)) - {"deepspeed", "torch", "numpy"}


@pytest.mark.parametrize("script", ["ci/setup.sh", "ci/package.sh"])
def test_every_pip_install_of_the_ci_scripts_is_constrained(script: str) -> None:
    with open(os.path.join(ROOT, script)) as f:
        text = f.read().replace("\\\n", " ")
    installs = [line for line in text.splitlines() if re.search(r"-m pip install\b", line)]
    assert installs, script
    for line in installs:
        assert re.search(r"-c \S*ci/constraints\.txt", line), line
