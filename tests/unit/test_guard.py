# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The guard: fingerprints of the installed DeepSpeed and of synthetic classes, and the version range."""

import importlib.util
import inspect
import sys
import textwrap

import pytest

from deepspeed_offload_patch import guard, overflow
from deepspeed_offload_patch.fingerprints import UNFIXED
from deepspeed_offload_patch.releases import PATCHED_RELEASES


def test_every_recorded_form_has_exactly_one_replacement():
    for name, forms in UNFIXED.items():
        for digest, releases in forms.items():
            assert guard.replacement_for(name, digest) is not None, (name, releases)
            matching = [
                spec for spec, _ in guard.replacements(name) if all(
                    guard.SpecifierSet(spec).contains(v) for v in releases)
            ]
            assert len(matching) == 1, (name, releases, matching)
        covered = sorted({v for releases in forms.values() for v in releases}, key=guard.Version)
        assert covered == list(PATCHED_RELEASES), name


def test_installed_deepspeed_is_a_recorded_unfixed_form():
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed_offload_patch import patcher
    for name in guard.ALL_METHODS:
        original = patcher._originals.get(name, DeepSpeedZeroOptimizer.__dict__[name])
        assert deepspeed.__version__ in UNFIXED[name][guard.fingerprint(original)], name


@pytest.mark.parametrize("version, supported", [("0.17.1", True), ("0.19.8", True), ("0.19.8+abc123", True),
                                                ("0.18.4", True), ("0.17.0", False), ("0.16.9", False),
                                                ("0.19.9", False), ("0.20.0", False), ("garbage", False)])
def test_supported_range(version, supported):
    assert guard.in_supported_range(version) is supported


def test_fingerprint_ignores_formatting_comments_and_docstring():
    a = "def f(self, x):\n    return x + 1\n"
    b = 'def g(self,   x):\n    """doc"""\n    # why\n    return (x + 1)\n'
    c = "def f(self, x):\n    return x + 2\n"
    assert guard.fingerprint_source(a) == guard.fingerprint_source(b) != guard.fingerprint_source(c)


def _synthetic_class(tmp_path, name: str, methods: str):
    """A module file defining ``DeepSpeedZeroOptimizer`` with ``methods`` (so its source is real and readable)."""
    path = tmp_path / f"{name}.py"
    path.write_text("import torch\n\nclass DeepSpeedZeroOptimizer:\n" + textwrap.indent(methods, "    "))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.DeepSpeedZeroOptimizer


def test_a_release_with_the_fixed_form_is_upstream_fixed(tmp_path):
    fixed = textwrap.dedent(inspect.getsource(overflow.update_offload_overflow_tracker)) + "\n" + textwrap.dedent(
        inspect.getsource(overflow.has_overflow))
    cls = _synthetic_class(tmp_path, "synthetic_fixed", fixed)
    decision = guard.inspect_target(cls, "0.20.0")
    assert decision.state == "upstream-fixed" and decision.replacements == {}, decision


def test_an_unknown_form_is_unsupported(tmp_path):
    changed = ("def update_offload_overflow_tracker(self, grad):\n    self.local_overflow = True\n\n"
               "def has_overflow(self, partition_gradients=True):\n    return self.local_overflow\n")
    cls = _synthetic_class(tmp_path, "synthetic_changed", changed)
    for version in ("0.19.8", "0.20.0"):
        decision = guard.inspect_target(cls, version)
        assert decision.state == "unsupported" and decision.replacements == {}, decision
    assert guard.inspect_target(cls, "0.19.8").methods == {
        "update_offload_overflow_tracker": guard.MISMATCH,
        "has_overflow": guard.MISMATCH
    }
