# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The guard: fingerprints of the installed DeepSpeed and of synthetic classes, and the version range."""

import inspect
import textwrap

import pytest

from deepspeed_offload_patch import guard
from deepspeed_offload_patch.changes import CHANGES, UPSTREAM
from deepspeed_offload_patch.changes.overflow_flag import methods as overflow
from deepspeed_offload_patch.changes.overflow_flag.probe import probe_tracker
from deepspeed_offload_patch.fingerprints import UNFIXED
from deepspeed_offload_patch.releases import PATCHED_RELEASES
from unit.common import synthetic_class


def test_every_recorded_form_has_exactly_one_replacement():
    for change in CHANGES:
        witnesses = {name for form in change.forms for name in form.witnesses}
        for name in set(change.method_names) - witnesses:  # witnesses are read, not replaced
            # Two changes may replace one method, each on its own releases (their forms never share a release).
            mine = {
                digest: releases
                for digest, releases in UNFIXED[change.key(name)].items()
                if change.form_of(releases[0]) and name in change.form_of(releases[0]).methods
            }
            for digest, releases in mine.items():
                assert guard.replacement_for(change, name, digest) is not None, (name, releases)
                # Every release of that form has the same replacement for it.
                functions = {dict(change.form_of(v).functions)[name] for v in releases}
                assert len(functions) == 1, (name, releases, functions)
            covered = sorted({v for releases in mine.values() for v in releases}, key=guard.Version)
            expected = [v for v in PATCHED_RELEASES if change.form_of(v) and name in change.form_of(v).methods]
            assert covered == expected, name


def test_each_recorded_form_of_a_method_belongs_to_exactly_one_change():
    """Where two changes replace one method, every recorded form is one change's alone."""
    for key, forms in UNFIXED.items():
        for digest, releases in forms.items():
            owners = [
                change.name for change in CHANGES for name in change.method_names
                if change.key(name) == key and change.form_of(releases[0])
                and name in change.form_of(releases[0]).methods + change.form_of(releases[0]).witnesses
            ]
            assert len(owners) == 1, (key, releases, owners)


def test_every_release_has_at_most_one_form_of_each_change_and_one_of_the_upstream_change():
    for change in CHANGES:
        for version in PATCHED_RELEASES:
            forms = [form for form in change.forms if guard.SpecifierSet(form.releases).contains(version)]
            assert len(forms) <= 1 and (forms or not change.upstream), (change.name, version, forms)
            for form in forms:
                assert all(
                    any(version in releases for releases in UNFIXED[change.key(name)].values())
                    for name in form.methods)


def test_installed_deepspeed_is_a_recorded_unfixed_form():
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed_offload_patch import patcher
    for name in UPSTREAM.form_for(DeepSpeedZeroOptimizer).methods:
        original = patcher.originals().get(name, DeepSpeedZeroOptimizer.__dict__[name])
        releases = UNFIXED[name][guard.fingerprint(original)]
        # A build newer than the releases tested (0.19.9 from 0.19.8's sdist) has one of their forms.
        assert guard.newer_than_tested(deepspeed.__version__) or deepspeed.__version__ in releases, name


@pytest.mark.parametrize("version, release, newer", [("0.14.0", "0.14.0", False), ("0.19.8", "0.19.8", False),
                                                     ("0.19.8+abc123", "0.19.8", False), ("0.13.5", "0.13.5", False),
                                                     ("0.19.9", "0.19.9", True), ("0.20.0.dev0", "0.20.0", True),
                                                     ("1.0.0", "1.0.0", True), ("garbage", None, False)])
def test_release_part_and_newer_than_tested(version, release, newer):
    assert str(guard.release_of(version)) == release if release else guard.release_of(version) is None
    assert guard.newer_than_tested(version) is newer


def test_fingerprint_ignores_formatting_comments_and_docstring():
    a = "def f(self, x):\n    return x + 1\n"
    b = 'def g(self,   x):\n    """doc"""\n    # why\n    return (x + 1)\n'
    c = "def f(self, x):\n    return x + 2\n"
    assert guard.fingerprint_source(a) == guard.fingerprint_source(b) != guard.fingerprint_source(c)


HEADER = "import torch\nfrom deepspeed import comm as dist\nfrom deepspeed.accelerator import get_accelerator\n"


def _synthetic_class(tmp_path, name: str, methods: str):
    """A module file defining ``DeepSpeedZeroOptimizer`` with ``methods`` (so its source is real and readable)."""
    return synthetic_class(tmp_path, name, methods, HEADER)


def test_a_release_with_the_fixed_form_is_upstream_fixed(tmp_path):
    fixed = textwrap.dedent(inspect.getsource(overflow.update_offload_overflow_tracker)) + "\n" + textwrap.dedent(
        inspect.getsource(overflow.has_overflow))
    cls = _synthetic_class(tmp_path, "synthetic_fixed", fixed)
    decision = guard.decide_by_methods(UPSTREAM, cls, "0.20.0")
    assert decision.state == "upstream-fixed" and decision.replacements == {}, decision


def test_an_unknown_form_is_unsupported(tmp_path):
    changed = ("def update_offload_overflow_tracker(self, grad):\n    self.local_overflow = True\n\n"
               "def has_overflow(self, partition_gradients=True):\n    return self.local_overflow\n")
    cls = _synthetic_class(tmp_path, "synthetic_changed", changed)
    for version in ("0.19.8", "0.20.0"):
        decision = guard.decide_by_methods(UPSTREAM, cls, version)
        assert decision.state == "unsupported" and decision.replacements == {}, decision
        # Read by an interpreter that digests the package's own code as recorded: DeepSpeed's code is the unknown.
        assert "not the code this patch was built for" in decision.reason and "Python" not in decision.reason
    assert guard.decide_by_methods(UPSTREAM, cls, "0.19.8").methods == {
        "update_offload_overflow_tracker": guard.MISMATCH,
        "has_overflow": guard.MISMATCH
    }


def _unfixed_sources() -> str:
    """The recorded unfixed sources of the installed DeepSpeed's two methods, as a class body."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed_offload_patch import patcher
    return "\n".join(
        textwrap.dedent(inspect.getsource(patcher.originals().get(name, DeepSpeedZeroOptimizer.__dict__[name])))
        for name in UPSTREAM.form_for(DeepSpeedZeroOptimizer).methods)


@pytest.mark.parametrize("version", ["0.19.9", "0.20.0.dev0", "0.21.0+abc123"])
def test_a_newer_version_with_a_known_form_is_patched_and_says_so(tmp_path, version):
    cls = _synthetic_class(tmp_path, f"synthetic_newer_{abs(hash(version))}", _unfixed_sources())
    decision = guard.decide_by_methods(UPSTREAM, cls, version)
    assert decision.state == "applied" and len(decision.replacements) == 2, decision
    assert f"DeepSpeed {version} is newer than the releases tested ({guard.FIRST} to {guard.LAST})" in decision.reason
    assert "match the unfixed form of DeepSpeed" in decision.reason, decision.reason


@pytest.mark.parametrize("version", ["0.13.5", "0.12.6"])
def test_an_older_version_is_unsupported_whatever_its_form(tmp_path, version):
    cls = _synthetic_class(tmp_path, f"synthetic_older_{abs(hash(version))}", _unfixed_sources())
    decision = guard.decide_by_methods(UPSTREAM, cls, version)
    assert decision.state == "unsupported" and decision.replacements == {}, decision
    assert f"older than the first supported release {guard.FIRST}" in decision.reason, decision.reason


def test_an_unparsable_version_is_unsupported_and_said_so(tmp_path):
    cls = _synthetic_class(tmp_path, "synthetic_unparsable", _unfixed_sources())
    decision = guard.decide_by_methods(UPSTREAM, cls, "not-a-version")
    assert decision.state == "unsupported" and decision.replacements == {}, decision
    assert "'not-a-version' cannot be parsed as a version" in decision.reason, decision.reason
    assert "older" not in decision.reason, decision.reason


# Fixed trackers in words other than this package's: in place and out of place, other names and expressions.
FIXED_TRACKERS = {
    "in-place-logical-or":
    """
def update_offload_overflow_tracker(self, grad):
    if grad is None or not self.check_grad_overflow:
        return
    bad = self._has_inf_or_nan(grad.data).bool()
    if isinstance(self.local_overflow, torch.Tensor):
        self.local_overflow.logical_or_(bad.to(self.local_overflow.device))
    else:
        self.local_overflow = bad.clone()
""",
    "out-of-place-torch-logical-or":
    """
def update_offload_overflow_tracker(self, grad):
    if self.check_grad_overflow and grad is not None:
        seen = self.local_overflow if torch.is_tensor(self.local_overflow) else torch.zeros((), dtype=torch.bool)
        self.local_overflow = torch.logical_or(seen, self._has_inf_or_nan(grad.data).to(torch.bool))
""",
    "max-accumulator":
    """
def update_offload_overflow_tracker(self, grad):
    if not self.check_grad_overflow:
        return
    if grad is not None:
        result = self._has_inf_or_nan(grad.data).float().reshape(())
        previous = self.local_overflow
        if not torch.is_tensor(previous):
            previous = torch.zeros_like(result)
        self.local_overflow = torch.maximum(previous.float(), result).bool()
""",
}
FIXED_HAS_OVERFLOW = """
def has_overflow(self, partition_gradients=True):
    device = get_accelerator().current_device_name()
    if self.cpu_offload:
        flag = self.local_overflow
        flag = flag if torch.is_tensor(flag) else torch.tensor(flag)
        overflow_gpu = flag.reshape(1).to(device=device, dtype=torch.uint8)
    else:
        overflow_gpu = self.has_overflow_partitioned_grads_serial().byte().to(device)
    dist.all_reduce(overflow_gpu, op=dist.ReduceOp.MAX, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=overflow_gpu, op=dist.ReduceOp.MAX)
    return bool(overflow_gpu[0].item())
"""
# Trackers that still read the host (or check with the check off), in ways the fingerprints never saw.
UNFIXED_TRACKERS = {
    "item":
    """
def update_offload_overflow_tracker(self, grad):
    if self.check_grad_overflow and self._has_inf_or_nan(grad.data).item():
        self.local_overflow = True
""",
    "or-of-tensors":
    """
def update_offload_overflow_tracker(self, grad):
    if self.check_grad_overflow:
        self.local_overflow = self.local_overflow or self._has_inf_or_nan(grad.data)
""",
    "any-tolist":
    """
def update_offload_overflow_tracker(self, grad):
    found = torch.stack([self._has_inf_or_nan(grad.data)]).tolist()
    if self.check_grad_overflow and any(found):
        self.local_overflow = True
""",
    "checks-with-check-off":
    """
def update_offload_overflow_tracker(self, grad):
    found = self._has_inf_or_nan(grad.data).bool()
    if self.check_grad_overflow:
        flag = self.local_overflow
        self.local_overflow = flag | found if torch.is_tensor(flag) else found
""",
    "host-flag":
    """
def update_offload_overflow_tracker(self, grad):
    if self.check_grad_overflow:
        self.local_overflow = int(self._has_inf_or_nan(grad.data).sum()) > 0 or self.local_overflow
""",
    "forgets":
    """
def update_offload_overflow_tracker(self, grad):
    if self.check_grad_overflow:
        self.local_overflow = self._has_inf_or_nan(grad.data).bool()
""",
}


@pytest.mark.parametrize("name", list(FIXED_TRACKERS))
@pytest.mark.parametrize("version", ["0.19.8", "0.20.0"])
def test_a_fix_in_other_words_is_upstream_fixed(tmp_path, name, version):
    cls = _synthetic_class(tmp_path, f"synthetic_fixed_{name.replace('-', '_')}_{version.replace('.', '_')}",
                           FIXED_TRACKERS[name] + FIXED_HAS_OVERFLOW)
    assert probe_tracker(cls) is None
    decision = guard.decide_by_methods(UPSTREAM, cls, version)
    assert decision.state == "upstream-fixed" and decision.replacements == {}, decision
    assert decision.methods["update_offload_overflow_tracker"] == guard.FIXED, decision


@pytest.mark.parametrize("name", list(UNFIXED_TRACKERS))
def test_a_tracker_that_still_reads_the_host_is_unsupported(tmp_path, name):
    cls = _synthetic_class(tmp_path, f"synthetic_unfixed_{name.replace('-', '_')}",
                           UNFIXED_TRACKERS[name] + FIXED_HAS_OVERFLOW)
    assert probe_tracker(cls) is not None
    decision = guard.decide_by_methods(UPSTREAM, cls, "0.20.0")
    assert decision.state == "unsupported" and decision.replacements == {}, decision
    assert decision.methods["update_offload_overflow_tracker"] == guard.MISMATCH, decision


def test_the_probe_finds_this_package_s_tracker_fixed(tmp_path):
    """The probe's idea of fixed is the patch's: our own tracker, compiled as DeepSpeed's, passes it."""
    source = textwrap.dedent(inspect.getsource(overflow.update_offload_overflow_tracker)) + FIXED_HAS_OVERFLOW
    cls = _synthetic_class(tmp_path, "synthetic_ours", source)
    assert probe_tracker(cls) is None
