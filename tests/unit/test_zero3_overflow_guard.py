# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The ZeRO-3 overflow fix's guard, on synthetic ``DeepSpeedZeroOptimizer_Stage3`` classes (module files written here,
so their source is real and readable): a known defective form is patched with the replacement of its form, the
package's own text in DeepSpeed's file is ``upstream-fixed``, code in no known form is ``not-needed`` where its
``step()`` skips an offloaded bf16 step with an invalid gradient norm and ``unsupported`` where it applies it, and the
method under DeepSpeed's NVTX decorator is read through it. The defective forms are made from the package's own
replacements with the fix taken out (their fingerprints are DeepSpeed's: comments do not count)."""

import inspect
import textwrap

import pytest

from deepspeed_offload_patch import guard
from deepspeed_offload_patch.changes import by_name
from deepspeed_offload_patch.changes.zero3_overflow import methods
from unit.common import synthetic_class

CHANGE = by_name("zero3-overflow")
METHOD = "_overflow_check_and_loss_scale_update"
HEADER = "import torch\n\n\ndef instrument_w_nvtx(func):\n\n    def wrapped_fn(*args, **kwargs):\n" \
         "        return func(*args, **kwargs)\n\n    return wrapped_fn\n"
# A step() of our own that skips a step whose gradient norm is invalid (-1), as DeepSpeed 0.19.8's does.
SKIPPING_STEP = """
def step(self, closure=None):
    self._pre_step()
    self._partition_all_parameters()
    if self._overflow_check_and_loss_scale_update():
        return
    norms = self._get_norm_groups()
    if any(float(norm) < 0 for norm in norms):
        self._overflow_clean_up(self.loss_scale)
        return
    self.timers("step")
    self._optimizer_step(0)
"""
# ... and one that applies it.
APPLYING_STEP = """
def step(self, closure=None):
    self._pre_step()
    self._partition_all_parameters()
    if self._overflow_check_and_loss_scale_update():
        return
    self._get_norm_groups()
    self._optimizer_step(0)
"""
# A tracker in no known form: fp16's check only, the flag reset first (0.19.8's shape, in our words).
UNKNOWN_TRACKER = """
def _overflow_check_and_loss_scale_update(self, update_scale=True):
    self.overflow = False
    if self.dtype == torch.float16:
        self.check_overflow()
    return self.overflow
"""


def _text(function, fixed: bool = True, decorated: bool = False) -> str:
    """``function`` of the change's ``methods`` as DeepSpeed's method (renamed); without the fix where not ``fixed``:
    DeepSpeed's defective form."""
    text = textwrap.dedent(inspect.getsource(function)).replace(f"def {function.__name__}(", f"def {METHOD}(")
    if not fixed:
        text = text.replace(" or self.offload_optimizer", "")
    return ("@instrument_w_nvtx\n" if decorated else "") + text


def _stage3(tmp_path, name: str, *methods_text: str):
    return synthetic_class(tmp_path, name, "\n".join(methods_text), HEADER, "DeepSpeedZeroOptimizer_Stage3")


@pytest.mark.parametrize("function, version", [(methods.overflow_check_and_loss_scale_update, "0.15.4"),
                                               (methods.overflow_check_with_loco_update, "0.19.7")],
                         ids=["without-loco", "with-loco"])
@pytest.mark.parametrize("decorated", [False, True], ids=["plain", "nvtx"])
def test_a_defective_form_gets_the_replacement_of_its_form(tmp_path, function, version, decorated):
    cls = _stage3(tmp_path, f"defective_{function.__name__}_{decorated}", _text(function, False, decorated),
                  APPLYING_STEP)
    decision = CHANGE.decide(CHANGE, cls, version)
    assert decision.state == "applied", decision
    assert decision.replacements == {METHOD: function}, decision
    assert "match a known unfixed form" in decision.reason, decision.reason


def test_a_newer_release_with_a_defective_form_is_patched_and_says_so(tmp_path):
    cls = _stage3(tmp_path, "defective_newer", _text(methods.overflow_check_with_loco_update, False), APPLYING_STEP)
    decision = CHANGE.decide(CHANGE, cls, "0.20.0")
    assert decision.state == "applied" and "newer than the releases tested" in decision.reason, decision


def test_the_package_s_text_in_deepspeed_s_file_is_upstream_fixed(tmp_path):
    """``patches/zero3-overflow`` applied to a release that has the defect: nothing to patch."""
    cls = _stage3(tmp_path, "diffed", _text(methods.overflow_check_with_loco_update), APPLYING_STEP)
    decision = CHANGE.decide(CHANGE, cls, "0.19.7")
    assert decision.state == "upstream-fixed" and decision.replacements == {}, decision


def test_a_step_that_skips_an_invalid_norm_itself_is_not_needed(tmp_path):
    cls = _stage3(tmp_path, "skips_itself", UNKNOWN_TRACKER, SKIPPING_STEP)
    decision = CHANGE.decide(CHANGE, cls, "0.19.8")
    assert decision.state == "not-needed" and decision.replacements == {}, decision


def test_unknown_code_that_applies_the_step_is_unsupported_and_says_what_it_does(tmp_path):
    cls = _stage3(tmp_path, "applies", UNKNOWN_TRACKER, APPLYING_STEP)
    decision = CHANGE.decide(CHANGE, cls, "0.19.8")
    assert decision.state == "unsupported" and decision.replacements == {}, decision
    assert "applies an offloaded bf16 step whose gradient norm is invalid" in decision.reason, decision.reason


def test_an_older_release_is_unsupported(tmp_path):
    cls = _stage3(tmp_path, "older", _text(methods.overflow_check_with_loco_update, False), APPLYING_STEP)
    assert CHANGE.decide(CHANGE, cls, "0.13.5").state == "unsupported"


def test_the_nvtx_wrapper_is_read_through():
    """DeepSpeed decorates the method with ``instrument_w_nvtx``, whose ``wrapped_fn`` copies nothing of it: the guard
    fingerprints the function inside; a function that is not so wrapped is itself."""
    from deepspeed.utils.nvtx import instrument_w_nvtx

    wrapped = instrument_w_nvtx(methods.overflow_check_with_loco_update)
    assert guard.unwrapped(wrapped) is methods.overflow_check_with_loco_update
    assert guard.fingerprint(wrapped) == guard.fingerprint(methods.overflow_check_with_loco_update)
    assert guard.unwrapped(methods.overflow_check_with_loco_update) is methods.overflow_check_with_loco_update
