# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The skipped-step fix's guard, probe and switches: applied where DeepSpeed has the defect (0.19.8's compact gradient
buffer kept after a skipped step), ``not-needed`` where it has no such buffer, ``upstream-fixed`` for a fix in other
words, ``unsupported`` for the defect in a new form, and each switch doing what it says. The training runs are in
``tests/unit/v1/zero/test_offload_skipped_step.py``."""

import importlib.util
import textwrap

import pytest

from deepspeed_offload_patch import guard, source_digest
from deepspeed_offload_patch.changes import by_name
from deepspeed_offload_patch.changes.skipped_step import methods as skipped_step
from deepspeed_offload_patch.changes.skipped_step.probe import probe_skipped_step

SKIPPED_STEP = by_name("skipped-step")
from deepspeed_offload_patch.states import State
from unit.common import run_command, run_python, synthetic_class
from unit.test_patch_lifecycle import run, warnings_in


def _compact_buffer_release() -> bool:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    return hasattr(DeepSpeedZeroOptimizer, "_use_compact_grad_partition_buffer")


def _originals():
    """DeepSpeed's own ``step`` and ``reset_cpu_buffers`` (this process may have patched the class)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from deepspeed_offload_patch import patcher
    return {
        name: patcher.originals().get(name, DeepSpeedZeroOptimizer.__dict__[name])
        for name in ("step", "reset_cpu_buffers")
    }


def _class_like_deepspeed(**methods):
    """A class in DeepSpeed's module (its code is DeepSpeed's own to the guard) with DeepSpeed's methods, some
    replaced by ``methods``."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    body = {k: v for k, v in vars(DeepSpeedZeroOptimizer).items() if k not in ("__dict__", "__weakref__")}
    body.update(_originals())
    body.update(methods)
    return type("DeepSpeedZeroOptimizer", DeepSpeedZeroOptimizer.__bases__, body)


def _synthetic(tmp_path, name: str, text: str) -> type:
    """``DeepSpeedZeroOptimizer`` of a module file holding ``text`` as its body, with 0.19.8's ``reset_cpu_buffers``
    and a compact buffer switch."""
    reset = textwrap.dedent(__import__("inspect").getsource(_originals()["reset_cpu_buffers"]))
    return synthetic_class(
        tmp_path, name,
        reset + "\n" + textwrap.dedent(text) + "\ndef _use_compact_grad_partition_buffer(self, group_idx):\n"
        "    return True\n")


needs_buffer = pytest.mark.skipif("not _compact_buffer_release()",
                                  reason="the installed DeepSpeed has no compact gradient buffer (before 0.19.8)")

# A step() whose overflow branch, with offload, drops the gradients itself (DeepSpeed's fix, in its own words), one
# that keeps them as 0.19.8 does, and one that fails on the stubs.
FIXED_STEP = """
def step(self, closure=None):
    self.overflow = False
    self.check_overflow(partition_gradients=self.partition_gradients)
    if self.overflow:
        self.zero_grad(set_to_none=True)
        if self.cpu_offload:
            self.reset_cpu_buffers()
        for k in self.averaged_gradients.keys():
            self.averaged_gradients[k] = None
        return
"""
STICKY_STEP = """
def step(self, closure=None):
    self.overflow = False
    self.check_overflow(partition_gradients=self.partition_gradients)
    if self.overflow:
        if self.cpu_offload:
            self.reset_cpu_buffers()
        return
"""
BROKEN_STEP = """
def step(self, closure=None):
    raise RuntimeError("needs a real engine")
"""


@needs_buffer
def test_deepspeed_0_19_8_is_patched_and_the_probe_agrees():
    import deepspeed
    cls = _class_like_deepspeed()
    decision = SKIPPED_STEP.decide(SKIPPED_STEP, cls, deepspeed.__version__)
    assert decision.state == "applied", decision
    assert decision.replacements == {"reset_cpu_buffers": skipped_step.reset_cpu_buffers}
    assert decision.methods == {"reset_cpu_buffers": guard.PATCHABLE, "step": guard.PATCHABLE}
    # The probe sees the defect in DeepSpeed's code, and none with the replacement.
    assert "keeps the skipped step's inf/NaN" in probe_skipped_step(cls)
    assert probe_skipped_step(_class_like_deepspeed(reset_cpu_buffers=skipped_step.reset_cpu_buffers)) is None
    assert SKIPPED_STEP.decide(SKIPPED_STEP, _class_like_deepspeed(reset_cpu_buffers=skipped_step.reset_cpu_buffers),
                               deepspeed.__version__).state == "applied"  # ours already


def test_without_a_compact_buffer_it_is_not_needed(tmp_path):
    path = tmp_path / "older.py"
    path.write_text(
        "class DeepSpeedZeroOptimizer:\n    def reset_cpu_buffers(self):\n        self.local_overflow = False\n")
    spec = importlib.util.spec_from_file_location("older_release", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    decision = SKIPPED_STEP.decide(SKIPPED_STEP, module.DeepSpeedZeroOptimizer, "0.19.7")
    assert decision.state == State.NOT_NEEDED and decision.replacements == {}, decision
    assert "no compact fp32 gradient partition buffer" in decision.reason


@needs_buffer
def test_a_fix_in_other_words_is_upstream_fixed(tmp_path):
    decision = SKIPPED_STEP.decide(SKIPPED_STEP, _synthetic(tmp_path, "fixed_step", FIXED_STEP), "0.20.0")
    assert decision.state == "upstream-fixed" and decision.replacements == {}, decision
    assert decision.methods["step"] == guard.MISMATCH


@needs_buffer
@pytest.mark.parametrize("text, why", [(STICKY_STEP, "keeps the skipped step's inf/NaN"),
                                       (BROKEN_STEP, "raised RuntimeError: needs a real engine")])
def test_the_defect_in_a_new_form_is_unsupported(tmp_path, text, why):
    decision = SKIPPED_STEP.decide(SKIPPED_STEP, _synthetic(tmp_path, f"new_form_{len(text)}", text), "0.20.0")
    assert decision.state == "unsupported" and decision.replacements == {}, decision
    assert why in decision.reason and "step: mismatch" in decision.reason, decision.reason


@needs_buffer
def test_a_foreign_reset_cpu_buffers_is_a_conflict():

    def someone_elses(self):
        pass

    decision = SKIPPED_STEP.decide(SKIPPED_STEP, _class_like_deepspeed(reset_cpu_buffers=someone_elses), "0.19.8")
    assert decision.state == "conflict" and "someone_elses" in decision.reason, decision


@needs_buffer
def test_an_interpreter_that_reads_code_otherwise_is_named(monkeypatch):
    real = source_digest._digest
    monkeypatch.setattr(source_digest, "_digest", lambda node: real(node)[::-1])
    decision = SKIPPED_STEP.decide(SKIPPED_STEP, _class_like_deepspeed(), "0.19.8")
    assert decision.state == "unsupported" and "the interpreter, not DeepSpeed" in decision.reason, decision


@pytest.mark.parametrize("version", ["0.13.5", "garbage"])
def test_a_refused_version_is_refused_for_both_changes(version):
    decision = SKIPPED_STEP.decide(SKIPPED_STEP, _class_like_deepspeed(), version)
    assert decision.state == "unsupported" and decision.reason == guard.version_refused(version)


# Each switch in a fresh interpreter, on the installed DeepSpeed.
STATES = """
    import deepspeed_offload_patch as dop
    import deepspeed
    status = dop.status()
    reset = target().__dict__["reset_cpu_buffers"]
    from deepspeed_offload_patch.changes.skipped_step import methods as skipped_step
    print("STATE", status.state, status.skipped_step, status.grad_norm_on_device, reset is skipped_step.reset_cpu_buffers)
"""


def _states(**env):
    output = run(STATES, **env)
    line = next(line for line in output.splitlines() if line.startswith("STATE "))
    return line.split()[1:], output


@needs_buffer
def test_on_by_default_and_each_switch_does_what_it_says():
    assert _states()[0] == ["applied", "applied", "applied", "True"]
    assert _states(DS_OFFLOAD_PATCH_SKIPPED_STEP="0")[0] == ["applied", "off", "applied", "False"]
    assert _states(DS_OFFLOAD_PATCH_GRAD_NORM="0")[0] == ["applied", "applied", "off", "True"]
    # Exactly the upstream change: neither this fix nor the grad norm, whatever their own switches say.
    assert _states(DS_OFFLOAD_PATCH_UPSTREAM_ONLY="1",
                   DS_OFFLOAD_PATCH_SKIPPED_STEP="1",
                   DS_OFFLOAD_PATCH_GRAD_NORM="1")[0] == ["applied", "off", "off", "False"]
    # Nothing decided: every change reads as the upstream one (off is only a switch's doing).
    assert _states(DS_OFFLOAD_PATCH_DISABLE="1")[0] == ["disabled", "disabled", "disabled", "False"]


@needs_buffer
@pytest.mark.parametrize("switch, expected, means",
                         [("DS_OFFLOAD_PATCH_SKIPPED_STEP", "off", "so the skipped-step fix is left out"),
                          ("DS_OFFLOAD_PATCH_UPSTREAM_ONLY", "off", "applies only the upstream change")])
def test_an_odd_value_warns_once_and_takes_the_fewer_changes(switch, expected, means):
    states, output = _states(**{switch: "maybe"})
    assert states[:2] == ["applied", expected], states
    lines = warnings_in(output)
    assert len(lines) == 1 and f"{switch}='maybe' is neither 0 nor 1" in lines[0] and means in lines[0], output


@needs_buffer
def test_revert_restores_the_original_and_apply_is_idempotent():
    run("""
        import deepspeed_offload_patch as dop
        import deepspeed
        from deepspeed_offload_patch.changes.skipped_step import methods as skipped_step
        cls = target()
        assert cls.__dict__["reset_cpu_buffers"] is skipped_step.reset_cpu_buffers
        patched = dict(cls.__dict__)
        assert dop.apply().skipped_step == "applied" and dict(cls.__dict__) == patched  # a second apply: no change
        status = dop.revert()
        assert status.skipped_step == "reverted", status
        from deepspeed_offload_patch import guard
        assert guard.fingerprint(cls.__dict__["reset_cpu_buffers"]) == "67bb6c042396d793"  # DeepSpeed's own again
        assert dop.apply().skipped_step == "applied"
        cls.reset_cpu_buffers = lambda self: None  # someone else, after the patch
        assert dop.status().skipped_step == "conflict"
    """)


@needs_buffer
def test_check_fails_when_the_fix_cannot_apply_and_strict_mode_raises(tmp_path):
    """DeepSpeed's own ``step()`` in a new form that still has the defect (a line added to its overflow branch):
    ``check`` exits 1 naming the fix and what the probe saw; strict mode raises at import; ``verify`` fails."""
    from unit.test_cli import CLI, deepspeed_copy

    def alter(path):
        text = path.read_text()
        anchor = "            if self.cpu_offload:\n                self.reset_cpu_buffers()\n"
        assert text.count(anchor) == 1
        path.write_text(text.replace(anchor, "            self.skipped_for_overflow = True\n" + anchor))

    import importlib.util
    import os
    env = deepspeed_copy(tmp_path, os.path.dirname(importlib.util.find_spec("deepspeed").origin), alter)
    check = run_command(CLI + ["check"], env=env)
    assert check.returncode == 1, check
    assert "FAIL (the skipped-step fix unsupported" in check.stdout, check
    assert "keeps the skipped step's inf/NaN" in check.stdout and "step: mismatch" in check.stdout, check
    strict = run_python("import deepspeed_offload_patch, deepspeed.runtime.zero.stage_1_and_2\n",
                        env=dict(env, DS_OFFLOAD_PATCH_STRICT="1"))
    assert strict.returncode != 0 and "skipped-step fix not applied (unsupported)" in strict.stderr, strict
    # verify shows the defect that is left: the step after a skipped one is skipped too.
    verify = run_command(CLI + ["verify"], env=env)
    assert verify.returncode == 1, verify
    assert "FAIL: with fp32 gradient accumulation, the step after a skipped one did not update" in verify.stdout, verify


def test_the_upstream_reproducer_applies_the_same_change():
    """``docs/upstream/repro_skipped_step.py`` carries the change itself, to stay self-contained for DeepSpeed's
    maintainers: it must be the package's replacement (the same fingerprint: code, not comments)."""
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                        "upstream", "repro_skipped_step.py")
    digests = source_digest.module_digests(path)
    assert digests["fixed_reset_cpu_buffers"] == guard.fingerprint(skipped_step.reset_cpu_buffers)
