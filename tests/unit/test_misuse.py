# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Misuse and broken environments: one clear message, no crash unless strict mode asks, DeepSpeed untouched.

Each case runs in a fresh interpreter. Live engines reverted mid-training are in
``v1/zero/test_offload_misuse.py``; odd switch values in ``test_patch_lifecycle.py``.
"""

import os
import sys
import textwrap

from unit.common import assert_ok, run_command
from unit.test_patch_lifecycle import run, warnings_in


def test_apply_from_many_threads_at_once():
    run("""
        import threading
        import deepspeed_offload_patch as dop
        from deepspeed_offload_patch import patcher

        assert "deepspeed" not in sys.modules and dop.status().state == "pending"
        barrier = threading.Barrier(8)
        states, errors = [], []

        def apply():
            barrier.wait()
            try:
                states.append(dop.apply().state)
            except BaseException as exc:
                errors.append(repr(exc))

        threads = [threading.Thread(target=apply) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors and states == ["applied"] * 8, (states, errors)
        cls = target()
        assert is_ours(cls) and dop.is_applied()
        originals = patcher.originals()
        # The fix's two methods, the grad norm's, and reset_cpu_buffers where the skipped-step fix applies (0.19.8).
        expected = ["complete_grad_norm_calculation_for_cpu_offload", "has_overflow", "update_offload_overflow_tracker"]
        if dop.status().skipped_step == "applied":
            expected = sorted(expected + ["reset_cpu_buffers"])
        assert sorted(originals) == expected, originals
        assert all(f.__module__ == "deepspeed.runtime.zero.stage_1_and_2" for f in originals.values()), originals
        assert dop.revert().state == "reverted"
        assert all(cls.__dict__[name] is original for name, original in originals.items())
    """)


def test_subclasses_that_override_a_patched_method_are_named():
    output = run("""
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        class BeforePatch(DeepSpeedZeroOptimizer):
            def has_overflow(self, partition_gradients=True):
                return False

        import deepspeed_offload_patch as dop
        assert dop.status().state == "applied"

        class AfterPatch(DeepSpeedZeroOptimizer):
            def update_offload_overflow_tracker(self, grad):
                pass

        class Inherits(AfterPatch):
            pass

        class NoOverride(DeepSpeedZeroOptimizer):
            def step(self, closure=None):
                return super().step(closure)

        assert dop.status().state == "applied" and is_ours(DeepSpeedZeroOptimizer)
        dop.revert()
        assert "__init_subclass__" not in DeepSpeedZeroOptimizer.__dict__

        class AfterRevert(DeepSpeedZeroOptimizer):
            def has_overflow(self, partition_gradients=True):
                return False
    """)
    lines = warnings_in(output)
    assert len(lines) == 2, output
    assert "BeforePatch overrides DeepSpeedZeroOptimizer.has_overflow" in lines[0], output
    assert "AfterPatch overrides DeepSpeedZeroOptimizer.update_offload_overflow_tracker" in lines[1], output


BROKEN_DEEPSPEED = {
    "deepspeed/__init__.py": "__version__ = '0.19.8'\n",
    "deepspeed/runtime/__init__.py": "",
    "deepspeed/runtime/zero/__init__.py": "",
    "deepspeed/runtime/zero/stage_1_and_2.py": "raise ImportError('stage_1_and_2 needs a module that is missing')\n",
}


def _broken_deepspeed(tmp_path) -> dict:
    for name, text in BROKEN_DEEPSPEED.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


IMPORT_THE_BROKEN_MODULE = """
    import deepspeed_offload_patch as dop
    assert dop.status().state == "pending", dop.status()
    try:
        import deepspeed.runtime.zero.stage_1_and_2
    except ImportError as exc:
        assert type(exc) is ImportError and str(exc) == "stage_1_and_2 needs a module that is missing", repr(exc)
    else:
        raise AssertionError("the broken module imported")
    status = dop.status()
    assert status.state == "unsupported", status
    assert "failed to import (ImportError: stage_1_and_2 needs a module that is missing)" in status.reason, status
"""


def test_a_deepspeed_whose_zero_module_fails_to_import(tmp_path):
    output = run(IMPORT_THE_BROKEN_MODULE, """
        assert dop.apply().state == "unsupported"
        assert not dop.is_applied()
    """, **_broken_deepspeed(tmp_path))
    lines = warnings_in(output)
    assert len(lines) == 1 and "failed to import" in lines[0] and "left unchanged" in lines[0], output


def test_a_deepspeed_whose_zero_module_fails_to_import_in_strict_mode(tmp_path):
    run(IMPORT_THE_BROKEN_MODULE,
        """
        try:
            dop.apply()
        except dop.PatchError as exc:
            assert isinstance(exc.__cause__, ImportError) and "failed to import" in str(exc), repr(exc)
        else:
            raise AssertionError("strict mode did not raise")
    """,
        DS_OFFLOAD_PATCH_STRICT="1",
        **_broken_deepspeed(tmp_path))


def test_check_reports_a_zero_module_that_fails_to_import(tmp_path):
    result = run_command([sys.executable, "-m", "deepspeed_offload_patch", "check"], env=_broken_deepspeed(tmp_path))
    assert result.returncode == 1, result
    assert "FAIL (unsupported, Python " in result.stdout and "failed to import (ImportError" in result.stdout, result


def test_check_reports_a_deepspeed_that_fails_to_import_before_its_zero_module(tmp_path):
    """DeepSpeed 0.14.0 with torch 2.13.0 fails in ``deepspeed/__init__.py``: the hook on the ZeRO module never hears
    of it, and ``check`` must still say why, not ``pending``."""
    env = _broken_deepspeed(tmp_path)
    (tmp_path / "deepspeed" / "__init__.py").write_text(
        "raise ImportError(\"cannot import name 'log' from 'torch.distributed.elastic.agent.server.api'\")\n")
    result = run_command([sys.executable, "-m", "deepspeed_offload_patch", "check"], env=env)
    assert result.returncode == 1, result
    assert "FAIL (unsupported, Python " in result.stdout and "cannot import name 'log'" in result.stdout, result


def test_the_import_hook_passes_a_failing_import_through_and_waits_for_a_good_one(tmp_path):
    module = tmp_path / "flaky_target.py"
    module.write_text("raise KeyError('not yet')\n")
    code = textwrap.dedent("""
        import importlib, sys
        from deepspeed_offload_patch import import_hook
        loaded, errors = [], []
        import_hook.when_imported("flaky_target", loaded.append, on_error=errors.append)
        try:
            import flaky_target
        except KeyError as exc:
            assert errors == [exc] and loaded == [], (errors, loaded)
        else:
            raise AssertionError("imported")
        open(sys.argv[1], "w").write("VALUE = 1\\n")
        importlib.invalidate_caches()
        import flaky_target
        assert loaded == [flaky_target] and flaky_target.VALUE == 1, loaded
        print("ok")
    """)
    result = run_command([sys.executable, "-c", code, str(module)], env={"PYTHONPATH": str(tmp_path)})
    assert "ok" in assert_ok(result)


def test_two_callbacks_that_wait_for_one_module_both_run_and_cancel_removes_only_its_own(tmp_path):
    """The patch's skip log and ``audit`` both wait for DeepSpeed's engine module: each callback runs once, in a fresh
    interpreter; the same callback registered twice is one hook; cancelling one callback leaves the other."""
    (tmp_path / "shared_target.py").write_text("VALUE = 1\n")
    (tmp_path / "other_target.py").write_text("VALUE = 2\n")
    code = textwrap.dedent("""
        from deepspeed_offload_patch import import_hook
        first, second, cancelled = [], [], []
        import_hook.when_imported("shared_target", first.append)
        import_hook.when_imported("shared_target", first.append)
        import_hook.when_imported("shared_target", second.append)
        import_hook.when_imported("other_target", cancelled.append)
        import_hook.when_imported("other_target", second.append)
        import_hook.cancel("other_target", cancelled.append)
        import shared_target, other_target
        assert first == [shared_target] and second == [shared_target, other_target], (first, second)
        assert cancelled == [], cancelled
        print("ok")
    """)
    result = run_command([sys.executable, "-c", code], env={"PYTHONPATH": str(tmp_path)})
    assert "ok" in assert_ok(result)
