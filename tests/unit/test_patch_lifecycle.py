# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""How the patch is applied, reverted, refused and reported: each case in a fresh interpreter."""

import textwrap

import pytest

from unit.common import assert_ok, run_python

# Shared by the child programs: names for the class and the package's replacement functions.
PRELUDE = """
import sys
def target():
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    return DeepSpeedZeroOptimizer
def ours(name):
    from deepspeed_offload_patch.changes import by_name
    return [func for _, func in by_name("overflow-flag").replacements(name)]
def is_ours(cls):
    return all(cls.__dict__[name] in ours(name) for name in ("update_offload_overflow_tracker", "has_overflow"))
"""


def run(*parts: str, **env) -> str:
    """Run the prelude and ``parts`` (each dedented on its own) in a fresh interpreter; return its output."""
    return assert_ok(run_python("\n".join(textwrap.dedent(part) for part in (PRELUDE, ) + parts), env=env))


def warnings_in(output: str):
    """The package's warnings: its lines but the INFO ones, which some DeepSpeed releases show (before DeepSpeed's
    logger is loaded, Python's last-resort handler prints warnings without a level)."""
    return [line for line in output.splitlines() if "[deepspeed_offload_patch]" in line and "[INFO]" not in line]


def test_import_before_deepspeed_waits_then_patches():
    run("""
        import deepspeed_offload_patch as dop
        assert "deepspeed" not in sys.modules, "importing the package must not import DeepSpeed"
        assert dop.status().state == "pending", dop.status()
        assert not dop.is_applied()
        import deepspeed
        assert dop.is_applied() and dop.status().state == "applied", dop.status()
        assert is_ours(target())
        import importlib.util
        if importlib.util.find_spec("deepspeed.runtime.zenflow"):  # ZenFlow arrived in 0.18
            from deepspeed.runtime.zenflow.zenflow_stage_1_and_2 import ZenFlowZeroOptimizerParallel
            assert ZenFlowZeroOptimizerParallel.update_offload_overflow_tracker in ours("update_offload_overflow_tracker")
    """)


@pytest.mark.parametrize("first", [
    "import deepspeed", "import deepspeed.runtime.zero.stage_1_and_2",
    "from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer"
])
def test_import_after_deepspeed_patches_at_once(first):
    run(f"""
        {first}
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as bound_before
        import deepspeed_offload_patch as dop
        assert dop.status().state == "applied", dop.status()
        assert is_ours(target()) and is_ours(bound_before)
    """)


def test_live_optimizer_gets_the_patch():
    run("""
        import torch
        cls = target()
        live = cls.__new__(cls)
        live.local_overflow = False
        import deepspeed_offload_patch
        live.update_offload_overflow_tracker(torch.tensor([1.0, float("inf")]))
        assert torch.is_tensor(live.local_overflow) and live.local_overflow.dtype == torch.bool
        assert live.local_overflow.item() is True
    """)


def test_apply_twice_then_revert_restores_the_originals():
    run("""
        cls = target()
        originals = dict(cls.__dict__)
        import deepspeed_offload_patch as dop
        first = dop.status()
        assert first.state == "applied", first
        assert dop.apply().state == "applied" and is_ours(cls)
        assert dop.revert().state == "reverted"
        for name in ("update_offload_overflow_tracker", "has_overflow"):
            assert cls.__dict__[name] is originals[name], name
        assert not dop.is_applied()
        assert dop.revert().state == "reverted"
        assert dop.apply().state == "applied" and is_ours(cls)
    """)


def test_revert_before_deepspeed_cancels_the_pending_patch():
    run("""
        import deepspeed_offload_patch as dop
        assert dop.status().state == "pending"
        assert dop.revert().state == "reverted"
        import deepspeed
        assert not is_ours(target()) and not dop.is_applied()
    """)


def test_revert_leaves_a_later_replacement_alone():
    output = run("""
        import deepspeed_offload_patch as dop
        cls = target()
        def theirs(self, grad):
            pass
        cls.update_offload_overflow_tracker = theirs
        assert dop.status().state == "conflict", dop.status()
        dop.revert()
        assert cls.__dict__["update_offload_overflow_tracker"] is theirs
        assert cls.__dict__["has_overflow"] not in ours("has_overflow")
    """)
    assert any("revert" in line and "left as is" in line for line in warnings_in(output)), output


def test_disabled_switch_makes_import_and_apply_no_ops():
    run("""
        import deepspeed_offload_patch as dop
        import deepspeed
        assert dop.status().state == "disabled", dop.status()
        assert dop.apply().state == "disabled"
        assert not is_ours(target()) and not dop.is_applied()
    """,
        DS_OFFLOAD_PATCH_DISABLE="1")


@pytest.mark.parametrize(
    "switch, state, after_apply, norm, means",
    [("DS_OFFLOAD_PATCH_DISABLE", "disabled", "disabled", "disabled", "treating it as 1, which leaves DeepSpeed"),
     ("DS_OFFLOAD_PATCH_GRAD_NORM", "applied", "applied", "off", "treating it as 0, so the on-device grad norm "
      "is left out"),
     ("DS_OFFLOAD_PATCH_AUTO", "not-applied", "applied", "not-applied", "treating it as 0, so importing the "
      "package patches nothing"),
     ("DS_OFFLOAD_PATCH_STRICT", "applied", "applied", "applied", "treating it as 0, not strict")])
def test_switch_with_odd_value_warns_once_and_says_what_it_does(switch, state, after_apply, norm, means):
    """The warning's reading is the one the package then follows (an odd STRICT patches, as 0 does; an odd GRAD_NORM
    leaves the grad norm out, as 0 does)."""
    output = run(
        f"""
        import deepspeed_offload_patch as dop
        import deepspeed
        status = dop.status()
        assert status.state == "{state}" and status.grad_norm_on_device == "{norm}", status
        assert is_ours(target()) == (status.state == "applied")
        after = dop.apply()
        assert after.state == "{after_apply}", after  # (AUTO leaves apply() working)
        from deepspeed_offload_patch.changes import by_name
        name = "complete_grad_norm_calculation_for_cpu_offload"
        installed = target().__dict__[name] in [form for _, form in by_name("grad-norm").replacements(name)]
        assert installed == (after.grad_norm_on_device == "applied"), after
        assert installed == ("{switch}" in ("DS_OFFLOAD_PATCH_STRICT", "DS_OFFLOAD_PATCH_AUTO")), after
    """, **{switch: "maybe"})
    lines = warnings_in(output)
    assert len(lines) == 1 and f"{switch}='maybe' is neither 0 nor 1" in lines[0] and means in lines[0], output


UNKNOWN_RELEASE = """
    import deepspeed_offload_patch as dop
    from deepspeed_offload_patch import patcher
    patcher.deepspeed_version = lambda: "0.13.5"
"""


def test_unknown_release_warns_once_and_leaves_deepspeed_untouched():
    output = run(
        UNKNOWN_RELEASE, """
        import deepspeed
        status = dop.status()
        assert status.state == "unsupported" and "0.13.5" in status.reason, status
        assert "older than the first supported release 0.14.0" in status.reason, status
        assert not is_ours(target())
        assert dop.apply().state == "unsupported"
    """)
    lines = warnings_in(output)
    assert len(lines) == 1 and "0.13.5" in lines[0] and "WARNING" in lines[0], output


def test_unknown_release_raises_in_strict_mode():
    run(UNKNOWN_RELEASE,
        """
        try:
            import deepspeed
        except dop.PatchError as exc:
            assert "0.13.5" in str(exc)
        else:
            raise AssertionError("strict mode did not raise")
        assert "deepspeed.runtime.zero.stage_1_and_2" not in sys.modules or not is_ours(target())
    """,
        DS_OFFLOAD_PATCH_STRICT="1")


def test_foreign_replacement_is_a_conflict_and_is_kept():
    output = run("""
        cls = target()
        def other_patch(self, partition_gradients=True):
            return False
        cls.has_overflow = other_patch
        import deepspeed_offload_patch as dop
        status = dop.status()
        assert status.state == "conflict" and "other_patch" in status.reason, status
        assert cls.__dict__["has_overflow"] is other_patch
        assert cls.__dict__["update_offload_overflow_tracker"] not in ours("update_offload_overflow_tracker")
    """)
    assert len(warnings_in(output)) == 1 and "conflict" in output, output


def test_a_newer_release_with_a_known_form_is_patched_with_one_info_line_per_change():
    # DeepSpeed's logger shows WARNING and above by default: the package's log calls are recorded instead.
    output = run("""
        import logging
        import deepspeed_offload_patch as dop
        from deepspeed_offload_patch import log, patcher
        from deepspeed_offload_patch.changes import CHANGES
        patcher.deepspeed_version = lambda: "0.20.0.dev0"
        calls = []
        log.log_once = lambda level, message: calls.append((logging.getLevelName(level), message))
        import deepspeed
        from deepspeed.runtime.zero import stage_1_and_2
        status = dop.status()
        assert status.state == "applied" and dop.is_applied(), status
        assert "DeepSpeed 0.20.0.dev0 is newer than the releases tested" in status.reason, status
        # One INFO line per change that applies, each saying the release is newer than those tested (the fix, the
        # grad norm, the skipped-step fix where it applies: 0.19.8's code); one for each change whose defect this code
        # does not have, saying it is not needed (the accumulation fixes: 0.19.8's code behaves right).
        assert status.grad_norm_on_device == "applied", status
        applied = [c for c in CHANGES if status.of(c)[0] == "applied"]
        needless = [c for c in CHANGES if status.of(c)[0] == "not-needed"]
        assert len(calls) == len(applied) + len(needless) and all(level == "INFO" for level, _ in calls), calls
        # DeepSpeed imports ZeRO-3's module first: the upstream change's line is not the first.
        first = next(message for _, message in calls if message.startswith(CHANGES[0].title))
        assert "newer than the releases tested" in first and "unfixed form of DeepSpeed" in first, calls
        assert sum("newer than the releases tested" in message for _, message in calls) == len(applied), calls
        assert sum(": not needed: " in message for _, message in calls) == len(needless), calls
    """)
    assert warnings_in(output) == [], output


def test_warnings_only_on_rank_zero():
    output = run(UNKNOWN_RELEASE,
                 """
        import deepspeed
        assert dop.status().state == "unsupported"
    """,
                 RANK="1")
    assert warnings_in(output) == [], output


@pytest.mark.parametrize("value, patched", [("", True), ("1", True), ("on", True), ("0", False), ("OFF", False)])
def test_auto_switch_values(value, patched):
    output = run(f"""
        import deepspeed_offload_patch as dop
        import deepspeed.runtime.zero.stage_1_and_2
        assert dop.status().state == ("applied" if {patched} else "not-applied"), dop.status()
        assert is_ours(target()) == {patched}
    """,
                 DS_OFFLOAD_PATCH_AUTO=value)
    assert warnings_in(output) == [], output


def test_without_deepspeed():
    output = run("""
        sys.modules["deepspeed"] = None  # as if DeepSpeed were not installed
        import deepspeed_offload_patch as dop
        assert dop.status().state == "deepspeed-missing", dop.status()
        try:
            dop.apply()
        except ImportError as exc:
            assert "deepspeed" in str(exc) and exc.name == "deepspeed"
        else:
            raise AssertionError("apply() without DeepSpeed did not raise ImportError")
    """)
    lines = warnings_in(output)
    assert len(lines) == 1 and "deepspeed-missing" in lines[0] and "pip install deepspeed" in lines[0], output
