# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The gradient-accumulation and several-backwards fixes' guards and probes, on synthetic classes: ``not-needed``
where the code keeps every micro-step / every backward (before the defect came and from DeepSpeed 0.19.0),
``unsupported`` for the defect in a form no release shipped (the reason says what it does), ``conflict`` when another
patch replaced the method, ``upstream-fixed`` where DeepSpeed's file holds this package's text (``patches/``
applied), and the switches. That each applies to a known defective form, and fixes it, is the training in
``tests/unit/v1/zero/test_offload_accumulation.py`` and what ``status`` prints on every release
(``tests/release/cli_golden``)."""

import importlib.util
import inspect
import sys
import textwrap

import pytest

from deepspeed_offload_patch.changes import by_name
from deepspeed_offload_patch.changes.grad_accumulation.probe import probe_accumulation
from deepspeed_offload_patch.changes.several_backwards.probe import probe_backwards
from deepspeed_offload_patch.states import State
from unit.common import synthetic_class
from unit.test_patch_lifecycle import run, warnings_in

GRAD_ACCUMULATION, SEVERAL_BACKWARDS = by_name("grad-accumulation"), by_name("several-backwards")

# The accumulation method's last lines, in three behaviours: store the running sum at micro-step 0 only (the defect,
# in a form no release shipped), at every micro-step (right), and code that fails on the probe's stubs.
_ACCUMULATE = """
def async_accumulate_grad_in_cpu_via_gpu(self, param):
    param_id = self.get_param_id(param)
    grad = self.get_param_gradient_attribute(param)
    if param_id not in self.accumulated_grads_in_cpu:
        self.accumulated_grads_in_cpu[param_id] = torch.zeros_like(grad)
    if self.micro_step_id > 0:
        grad.add_(self.accumulated_grads_in_cpu[param_id])
    {store}
"""
DROPS_THE_MIDDLE = _ACCUMULATE.format(store="if self.micro_step_id == 0:\n        "
                                      "self.accumulated_grads_in_cpu[param_id].copy_(grad)")
KEEPS_EVERY_STEP = _ACCUMULATE.format(store="self.accumulated_grads_in_cpu[param_id].copy_(grad)")
NEEDS_AN_ENGINE = """
def async_accumulate_grad_in_cpu_via_gpu(self, param):
    raise RuntimeError("needs a real engine")
"""
# copy_grads_in_partition's offload branch: through the CPU buffer with accumulation only (the defect), or whenever
# more than one backward makes the step (right).
_COPY = """
def copy_grads_in_partition(self, param):
    if self.cpu_offload:
        if {when}:
            self.async_accumulate_grad_in_cpu_via_gpu(param)
        if self.is_gradient_accumulation_boundary:
            self.async_inplace_copy_grad_to_fp32_buffer_from_gpu(param)
        return
"""
LAST_ONLY = _COPY.format(when="self.gradient_accumulation_steps > 1")
EVERY_BACKWARD = _COPY.format(when="self.micro_step_id > 0 or not self.is_gradient_accumulation_boundary")


def _synthetic(tmp_path, name: str, text: str) -> type:
    """``DeepSpeedZeroOptimizer`` of a module file holding ``text`` as its body (torch imported)."""
    return synthetic_class(tmp_path, name, text, "import torch\n")


def _ours(change, tmp_path) -> type:
    """A class whose method is this package's replacement text, as in DeepSpeed's file with ``patches/`` applied."""
    name = change.forms[-1].tracker
    function = dict(change.replacements(name))[change.forms[-1].releases]
    text = textwrap.dedent(inspect.getsource(function)).replace(f"def {function.__name__}(", f"def {name}(", 1)
    header = "from deepspeed.accelerator import get_accelerator\nfrom deepspeed.runtime.utils import see_memory_usage\n"
    path = tmp_path / f"ours_{change.state_key}.py"
    path.write_text(header + "import torch\n\n\nclass DeepSpeedZeroOptimizer:\n" + textwrap.indent(text, "    "))
    spec = importlib.util.spec_from_file_location(f"ours_{change.state_key}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.DeepSpeedZeroOptimizer


def test_the_installed_release_behaves_as_its_state_says():
    """On the installed DeepSpeed each fix reads ``applied`` where the record names a defective form for the release
    and ``not-needed`` elsewhere (0.19.x: decided by the probe alone, so a probe that took right code for wrong would
    read ``unsupported``), and the probe agrees: it finds the defect exactly where the fix applies."""
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from deepspeed_offload_patch import patcher
    originals = patcher.originals()
    for change, probe in ((GRAD_ACCUMULATION, probe_accumulation), (SEVERAL_BACKWARDS, probe_backwards)):
        name = change.forms[-1].tracker
        body = dict(vars(DeepSpeedZeroOptimizer), **{name: originals.get(name, DeepSpeedZeroOptimizer.__dict__[name])})
        cls = type("DeepSpeedZeroOptimizer", DeepSpeedZeroOptimizer.__bases__, body)
        decision = change.decide(change, cls, deepspeed.__version__)
        expected = State.NOT_NEEDED if change.form_of(deepspeed.__version__) is None else State.APPLIED
        assert decision.state == expected, (change.name, decision)
        assert (probe(cls) is None) == (expected == State.NOT_NEEDED), (change.name, probe(cls))


@pytest.mark.parametrize(
    "change, text, state, why", [
        (GRAD_ACCUMULATION, KEEPS_EVERY_STEP, State.NOT_NEEDED, "every micro-step's gradient reaches the step"),
        (GRAD_ACCUMULATION, DROPS_THE_MIDDLE, State.UNSUPPORTED, "trains on micro-steps 0, 2 of 0 - 2"),
        (GRAD_ACCUMULATION, NEEDS_AN_ENGINE, State.UNSUPPORTED, "raised RuntimeError: needs a real engine"),
        (SEVERAL_BACKWARDS, EVERY_BACKWARD, State.NOT_NEEDED, "every backward of a step reaches it"),
        (SEVERAL_BACKWARDS, LAST_ONLY, State.UNSUPPORTED, "keeps no backward's gradient of a step of 2 backwards"),
    ],
    ids=["accumulation-right", "accumulation-drops", "accumulation-raises", "backwards-right", "backwards-last-only"])
def test_code_in_no_known_form_is_decided_by_what_it_does(tmp_path, change, text, state, why):
    cls = _synthetic(tmp_path, f"{change.state_key}_{state.value.replace('-', '_')}_{len(text)}", text)
    decision = change.decide(change, cls, "0.20.0")
    assert decision.state == state and decision.replacements == {}, decision
    assert why in decision.reason, decision.reason


@pytest.mark.parametrize("change", [GRAD_ACCUMULATION, SEVERAL_BACKWARDS], ids=lambda c: c.name)
def test_the_package_s_own_text_in_deepspeed_s_file_is_upstream_fixed(tmp_path, change):
    decision = change.decide(change, _ours(change, tmp_path), "0.17.6")
    assert decision.state == State.UPSTREAM_FIXED and decision.replacements == {}, decision


def test_the_same_text_on_a_release_from_before_the_defect_is_not_needed(tmp_path):
    """The fix's text on a release from before the defect (0.14.0 - 0.15.1 store the running sum as the fix does) is
    that release's own way, not a fix applied to it: ``not-needed``, not ``upstream-fixed``."""
    decision = GRAD_ACCUMULATION.decide(GRAD_ACCUMULATION, _ours(GRAD_ACCUMULATION, tmp_path), "0.15.1")
    assert decision.state == State.NOT_NEEDED and decision.replacements == {}, decision


@pytest.mark.parametrize("change", [GRAD_ACCUMULATION, SEVERAL_BACKWARDS], ids=lambda c: c.name)
def test_a_method_replaced_by_another_patch_is_a_conflict(change):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    def someone_elses(self, param):
        pass

    name = change.forms[-1].tracker
    cls = type("DeepSpeedZeroOptimizer", DeepSpeedZeroOptimizer.__bases__,
               dict(vars(DeepSpeedZeroOptimizer), **{name: someone_elses}))
    decision = change.decide(change, cls, "0.17.6")
    assert decision.state == State.CONFLICT and "someone_elses" in decision.reason, decision


def test_each_switch_and_upstream_only_leave_their_change_out():
    """Each fix's switch at 0 turns it ``off`` and leaves the other as it was; ``UPSTREAM_ONLY`` turns both off; no
    switch warns."""
    output = run("""
        import os, subprocess, sys, json
        for env in ({"DS_OFFLOAD_PATCH_GRAD_ACCUMULATION": "0"}, {"DS_OFFLOAD_PATCH_SEVERAL_BACKWARDS": "0"},
                    {"DS_OFFLOAD_PATCH_UPSTREAM_ONLY": "1"}, {}):
            out = subprocess.run([sys.executable, "-m", "deepspeed_offload_patch", "status", "--json"],
                                 env=dict(os.environ, **env), capture_output=True, text=True).stdout
            status = json.loads(out)
            print("STATES", json.dumps(env), status["grad_accumulation"], status["several_backwards"])
    """)
    assert warnings_in(output) == [], output
    lines = {line.split(" ", 2)[1]: line.split()[-2:] for line in output.splitlines() if line.startswith("STATES ")}
    defaults = lines["{}"]
    assert set(defaults) <= {"applied", "not-needed"} and len(lines) == 4, (defaults, lines)
    for env, (accumulation, backwards) in lines.items():
        for key, default, state in (("GRAD_ACCUMULATION", defaults[0], accumulation), ("SEVERAL_BACKWARDS",
                                                                                       defaults[1], backwards)):
            left_out = key in env or "UPSTREAM_ONLY" in env
            assert state == ("off" if left_out else default), (env, state, default)
