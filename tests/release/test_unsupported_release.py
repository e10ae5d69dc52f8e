# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""On a DeepSpeed the package does not know (a release before the supported range, or code that matches no known
form, such as the ``truth-test`` variant of ``ci/noxfile.py``: a tracker that still reads the host in a new way): the
import leaves the fix's methods untouched, with one WARNING naming the installed version and why, ``status()`` says
``unsupported`` and the gate fails. (The skipped-step fix and the grad norm decide on their own methods: on
``truth-test``, whose ``step()``, ``reset_cpu_buffers`` and grad norm are 0.19.8's, they apply.)

Not in the default suite (``testpaths`` is ``tests/unit``): it needs such a DeepSpeed installed. ``ci/noxfile.py``
runs it in the sessions of such builds.
"""

import sys

from unit.common import run_command, run_python


def test_old_release_is_left_untouched_with_one_warning():
    result = run_python("""
        import deepspeed_offload_patch as dop
        import deepspeed
        from deepspeed.runtime.zero import stage_1_and_2
        from deepspeed_offload_patch.changes import CHANGES, by_name
        status = dop.status()
        assert status.state == "unsupported", status
        assert not dop.is_applied()
        cls = stage_1_and_2.DeepSpeedZeroOptimizer
        # The fix's methods stay DeepSpeed's own. The skipped-step fix and the grad norm decide on methods of their
        # own: where those are a known form (truth-test keeps 0.19.8's) they apply, and say so in their own states.
        skipped_step = set(by_name("skipped-step").method_names) if status.skipped_step == "applied" else set()
        grad_norm = set(by_name("grad-norm").method_names) if status.grad_norm_on_device == "applied" else set()
        for change in CHANGES:
            for name in set(change.method_names) - skipped_step - grad_norm:
                func = cls.__dict__.get(name)
                assert func is None or func.__code__.co_filename == stage_1_and_2.__file__, name
                assert all(func is not ours for _, ours in change.replacements(name)), name
        assert status.skipped_step in ("applied", "not-needed", "unsupported"), status
        assert status.grad_norm_on_device in ("applied", "unsupported"), status
        print("version", deepspeed.__version__, "version")
    """)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    warnings = [line for line in output.splitlines() if "[deepspeed_offload_patch]" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0], output
    version = output.split("version ")[-1].split(" version")[0]
    assert f"DeepSpeed {version}" in warnings[0], warnings
    assert "older than the first supported release" in warnings[0] or "not the code" in warnings[0], warnings


def test_gate_fails_on_old_release():
    result = run_command([sys.executable, "-m", "deepspeed_offload_patch", "check"])
    assert result.returncode == 1 and "unsupported" in result.stdout, result
