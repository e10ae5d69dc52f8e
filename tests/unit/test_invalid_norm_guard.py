# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The invalid-norm fix's guard, on synthetic ``DeepSpeedZeroOptimizer`` classes (module files written here, so their
source is real and readable): each known defective form of ``scaled_global_norm`` (with ``_update_scale``) is patched
with the replacements of its form, the package's own text in DeepSpeed's file is ``upstream-fixed``, code in no known
form is ``not-needed`` where its ``step()`` skips an offloaded fp32 step with an invalid gradient norm and
``unsupported`` where it applies it. The defective forms are made from the package's replacements with the fix taken
out, and must have the fingerprints of the releases they stand for (comments do not count)."""

import inspect
import re
import textwrap

import pytest

from deepspeed_offload_patch import guard
from deepspeed_offload_patch.changes import by_name
from deepspeed_offload_patch.changes.invalid_norm import methods
from deepspeed_offload_patch.fingerprints import UNFIXED
from unit.common import synthetic_class

CHANGE = by_name("invalid-norm")
NORM, SCALE = "scaled_global_norm", "_update_scale"
# step() as DeepSpeed 0.14.0 - 0.19.7 order it: the overflow branch, then the norm, then the optimizer loop.
APPLYING_STEP = """
def step(self, closure=None):
    self._update_scale(self.overflow)
    if self.overflow:
        self.reset_cpu_buffers()
        return
    norm = self.scaled_global_norm()
    self.real_dp_process_group[0]
"""
# A norm and a step of our own that skip an invalid norm, as DeepSpeed 0.19.8's do.
SKIPPING = """
def scaled_global_norm(self, norm_type=2):
    norms = torch.stack([self.complete_grad_norm_calculation_for_cpu_offload(p) for p in self.params_in_partition])
    return torch.where((norms < 0).any(), torch.tensor(float("inf")), torch.linalg.vector_norm(norms))

def step(self, closure=None):
    if not torch.isfinite(self.scaled_global_norm()):
        self.overflow = True
    self._update_scale(self.overflow)
    if self.overflow:
        self.reset_cpu_buffers()
        return
    self.real_dp_process_group[0]
"""
UNKNOWN_NORM = """
def scaled_global_norm(self, norm_type=2):
    norms = [self.complete_grad_norm_calculation_for_cpu_offload(p) for p in self.params_in_partition]
    return torch.linalg.vector_norm(torch.stack(norms), ord=norm_type)
"""


def _text(function, name: str, fixed: bool) -> str:
    """``function`` of the change's ``methods`` as DeepSpeed's method ``name``; without the fix where not ``fixed``:
    DeepSpeed's defective form."""
    text = textwrap.dedent(inspect.getsource(function)).replace(f"def {function.__name__}(", f"def {name}(")
    if fixed:
        return text
    if name == SCALE:
        return text[:text.index(":\n") + 2] + "    self.loss_scaler.update_scale(has_overflow)\n"
    text = re.sub(r"    norm = getattr\(self, \"_step_grad_norm\", None\)\n.*?return norm\n", "", text, flags=re.S)
    text = text.replace(
        "norm = self.complete_grad_norm_calculation_for_cpu_offload(self.params_in_partition[i])\n"
        "            norm_groups.append(torch.tensor(float(norm), device=self.device))",
        "norm = torch.tensor(self.complete_grad_norm_calculation_for_cpu_offload(self.params_in_partition[i]), "
        "device=self.device)\n            norm_groups.append(norm)")
    text = re.sub(r"    norms = torch.stack\(norm_groups\)\n.*?return (.*?)\(norms,",
                  r"    return \1(torch.stack(norm_groups),",
                  text,
                  flags=re.S)
    return text


def _class(tmp_path, name: str, *texts: str):
    return synthetic_class(tmp_path, name, "\n".join(texts), "import torch\n")


FORMS = [(methods.scaled_global_norm_of_numbers_torch_norm, "0.15.4"),
         (methods.scaled_global_norm_of_numbers, "0.16.9"), (methods.scaled_global_norm, "0.19.7")]


@pytest.mark.parametrize("function, version", FORMS, ids=[version for _, version in FORMS])
def test_a_defective_form_gets_the_replacements_of_its_form(tmp_path, function, version):
    norm, scale = _text(function, NORM, False), _text(methods._update_scale, SCALE, False)
    cls = _class(tmp_path, f"defective_{function.__name__}", norm, scale, APPLYING_STEP)
    # The texts made here are DeepSpeed's forms: the release's own fingerprints.
    assert version in UNFIXED[NORM][guard.fingerprint(cls.__dict__[NORM])]
    assert version in UNFIXED[SCALE][guard.fingerprint(cls.__dict__[SCALE])]
    decision = CHANGE.decide(CHANGE, cls, version)
    assert decision.state == "applied", decision
    assert decision.replacements == {NORM: function, SCALE: methods._update_scale}, decision


def test_a_newer_release_with_a_defective_form_is_patched_and_says_so(tmp_path):
    norm, scale = _text(methods.scaled_global_norm, NORM, False), _text(methods._update_scale, SCALE, False)
    cls = _class(tmp_path, "defective_newer", norm, scale, APPLYING_STEP)
    decision = CHANGE.decide(CHANGE, cls, "0.20.0")
    assert decision.state == "applied" and "newer than the releases tested" in decision.reason, decision


def test_the_package_s_text_in_deepspeed_s_file_is_upstream_fixed(tmp_path):
    """``patches/invalid-norm`` applied to a release that has the defect: nothing to patch."""
    norm, scale = _text(methods.scaled_global_norm, NORM, True), _text(methods._update_scale, SCALE, True)
    cls = _class(tmp_path, "diffed", norm, scale, APPLYING_STEP)
    decision = CHANGE.decide(CHANGE, cls, "0.19.7")
    assert decision.state == "upstream-fixed" and decision.replacements == {}, decision


def test_a_step_that_skips_an_invalid_norm_itself_is_not_needed(tmp_path):
    cls = _class(tmp_path, "skips_itself", SKIPPING, _text(methods._update_scale, SCALE, False))
    decision = CHANGE.decide(CHANGE, cls, "0.19.8")
    assert decision.state == "not-needed" and decision.replacements == {}, decision


def test_unknown_code_that_applies_the_step_is_unsupported_and_says_what_it_does(tmp_path):
    cls = _class(tmp_path, "applies", UNKNOWN_NORM, _text(methods._update_scale, SCALE, False), APPLYING_STEP)
    decision = CHANGE.decide(CHANGE, cls, "0.19.8")
    assert decision.state == "unsupported" and decision.replacements == {}, decision
    assert "applies an offloaded fp32 step whose gradient norm is invalid" in decision.reason, decision.reason


def test_an_older_release_is_unsupported(tmp_path):
    norm, scale = _text(methods.scaled_global_norm, NORM, False), _text(methods._update_scale, SCALE, False)
    cls = _class(tmp_path, "older", norm, scale, APPLYING_STEP)
    assert CHANGE.decide(CHANGE, cls, "0.13.5").state == "unsupported"
