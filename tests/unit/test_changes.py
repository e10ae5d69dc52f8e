# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The registry of changes: each change is one record, in one module folder, and the rest of the package knows it
only through the registry (``docs/design.md``, "Adding a change")."""

import os
import re

import pytest

from deepspeed_offload_patch import changes, settings
from deepspeed_offload_patch.changes import CHANGES, OTHERS, UPSTREAM, by_name
from deepspeed_offload_patch.changes.record import Change, Form

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "deepspeed_offload_patch")
#: Modules that may name a change, and why: the test harness runs the training each change's tests compare (a run
#: with and without a given change), and the benchmark measures the on-device grad norm apart from the fix.
MAY_NAME = {
    os.path.join("changes", "__init__.py"): "the registry: one line per change",
    "fingerprints.py": "generated: the package's own digests are keyed by change",
    os.path.join("testing", "equivalence.py"): "the harness compares runs with and without a given change",
    "bench.py": "the benchmark times the grad norm apart from the boundary backward's fix",
    "bench_report.py": "the benchmark's tables name the variant it measures",
}


def _module(change: Change) -> str:
    return change.name.replace("-", "_")


def marks(change: Change) -> list:
    """What names ``change`` in code or text: its name, its switch, its module and the keys of its state."""
    found = [change.name, f"changes.{_module(change)}", f"import {_module(change)}"]
    if change.switch:
        found.append(change.switch)
    if not change.upstream:
        found += [change.state_key, change.reason_key]
    return found


def namings(root: str = PACKAGE) -> list:
    """``(file, change, mark)`` for every place a package file outside a change's own folder names that change."""
    found = []
    for folder, _, files in os.walk(root):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, root)
            if relative in MAY_NAME:
                continue
            text = open(path).read()
            for change in CHANGES:
                if relative.startswith(os.path.join("changes", _module(change)) + os.sep):
                    continue
                for mark in marks(change):
                    if re.search(rf"(?<![\w]){re.escape(mark)}(?![\w-])", text):
                        found.append((relative, change.name, mark))
    return found


def test_no_package_module_names_a_change_but_its_own():
    assert namings() == []


def test_a_change_named_elsewhere_is_caught(tmp_path):
    (tmp_path / "cli.py").write_text(f'FLAG = "--{OTHERS[0].name}"\n')
    (tmp_path / "settings.py").write_text(f'SWITCH = "{OTHERS[0].switch}"\n')
    (tmp_path / "guard.py").write_text(f"from deepspeed_offload_patch.changes.{_module(UPSTREAM)} import probe\n")
    own = tmp_path / "changes" / _module(OTHERS[0])
    own.mkdir(parents=True)
    (own / "__init__.py").write_text(f'NAME = "{OTHERS[0].name}"\n')  # its own module may
    assert sorted(namings(str(tmp_path))) == sorted([("cli.py", OTHERS[0].name, OTHERS[0].name),
                                                     ("settings.py", OTHERS[0].name, OTHERS[0].switch),
                                                     ("guard.py", UPSTREAM.name, f"changes.{_module(UPSTREAM)}")])


def test_every_change_module_is_registered_once_under_its_name():
    folders = sorted(name for name in os.listdir(os.path.join(PACKAGE, "changes"))
                     if os.path.isfile(os.path.join(PACKAGE, "changes", name, "__init__.py")))
    assert folders == sorted(_module(change) for change in CHANGES)
    assert len({change.name for change in CHANGES}) == len(CHANGES)
    assert [change.upstream for change in CHANGES] == [True] + [False] * len(OTHERS)
    keys = [key for change in OTHERS for key in (change.state_key, change.reason_key)]
    assert len(set(keys)) == len(keys) and not {"state", "reason", "methods", "deepspeed_version"} & set(keys)
    for change in CHANGES:
        assert by_name(change.name) is change
        assert change.defect[0] and change.defect[1] and change.title and change.label and change.about
    with pytest.raises(LookupError, match="no change is called"):
        by_name("no-such-change")


def test_a_switch_is_the_change_s_name_in_capitals():
    assert UPSTREAM.switch is None
    for change in OTHERS:
        assert change.switch == settings.NAME_PREFIX + change.name.upper().replace("-", "_")


def test_each_form_names_a_replacement_for_each_method_and_the_forms_do_not_overlap():
    from packaging.specifiers import SpecifierSet

    from deepspeed_offload_patch.releases import PATCHED_RELEASES
    for change in CHANGES:
        module = change.methods()
        # A change that sets a default replaces no method: its module makes the default.
        assert module.__name__ == f"{changes.__name__}.{_module(change)}.{'default' if change.default else 'methods'}"
        assert bool(change.forms) != bool(change.default), change.name
        for form in change.forms:
            for method, function in form.functions:
                assert callable(getattr(module, function)), (change.name, method, function)
        for version in PATCHED_RELEASES:
            assert sum(SpecifierSet(form.releases).contains(version) for form in change.forms) <= 1


def test_a_form_refuses_a_tracker_or_a_method_without_its_replacement():
    with pytest.raises(ValueError, match="tracker"):
        Form(("a", ), tracker="b", first_release="0.14.0", functions=(("a", "f"), ))
    with pytest.raises(ValueError, match="replacement"):
        Form(("a", "b"), tracker="a", first_release="0.14.0", functions=(("a", "f"), ))
