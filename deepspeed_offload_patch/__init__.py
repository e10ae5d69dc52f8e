# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Keep DeepSpeed's ZeRO-1/2 offload overflow flag on the device (DeepSpeed pull request 8963, as a patch).

Importing this package applies the patch: now, if ``deepspeed.runtime.zero.stage_1_and_2`` is already imported, or
right after it is imported. It never imports DeepSpeed itself. On a DeepSpeed it does not know, on a conflicting
patch, it leaves DeepSpeed untouched and says why in ``status()`` and in one WARNING (an error under
``DS_OFFLOAD_PATCH_STRICT=1``). Without DeepSpeed it warns once, strict or not: there is no training to guard, and
``import deepspeed`` fails on its own. ``DS_OFFLOAD_PATCH_DISABLE=1`` turns the import into a no-op.
"""

from deepspeed_offload_patch.patcher import (GOOD_STATES, PatchError, PatchStatus, apply, is_applied, patch_on_import,
                                             revert, status)
from deepspeed_offload_patch.skip_log import skipped_steps

__version__ = "0.2.0.dev0"
__all__ = [
    "apply", "revert", "is_applied", "status", "skipped_steps", "PatchStatus", "PatchError", "GOOD_STATES",
    "__version__"
]

patch_on_import()
