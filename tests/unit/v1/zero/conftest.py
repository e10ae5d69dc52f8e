# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The opt-in on-device gradient norm replaces a method of DeepSpeed 0.17.1 and later, and the skipped-step fix one
whose defect came with 0.19.8's compact gradient buffer: on older releases there is nothing for their tests to test
(the package reports the opt-in as unsupported there, the fix as not-needed), nor where DeepSpeed fixed it itself, so
they are not collected."""

from deepspeed_offload_patch.testing.equivalence import per_param_tracker


def _has_the_skipped_step_defect() -> bool:
    """DeepSpeed keeps a compact gradient buffer (0.19.8) and has not fixed what it keeps after a skipped step (the
    package says ``upstream-fixed`` where it has)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    import deepspeed_offload_patch
    return (hasattr(DeepSpeedZeroOptimizer, "_use_compact_grad_partition_buffer")
            and deepspeed_offload_patch.status().skipped_step != "upstream-fixed")


collect_ignore = (["test_offload_grad_norm.py"] if per_param_tracker() else []) + \
    ([] if _has_the_skipped_step_defect() else ["test_offload_skipped_step.py"])
