# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The skipped-step fix replaces a method whose defect came with 0.19.8's compact gradient buffer: on older releases
there is nothing for its tests to test (the package reports the fix as not-needed there), nor where DeepSpeed fixed it
itself, so they are not collected."""


def _has_the_skipped_step_defect() -> bool:
    """DeepSpeed keeps a compact gradient buffer (0.19.8) and has not fixed what it keeps after a skipped step (the
    package says ``upstream-fixed`` where it has)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    import deepspeed_offload_patch
    return (hasattr(DeepSpeedZeroOptimizer, "_use_compact_grad_partition_buffer")
            and deepspeed_offload_patch.status().skipped_step != "upstream-fixed")


collect_ignore = [] if _has_the_skipped_step_defect() else ["test_offload_skipped_step.py"]
