# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The DeepSpeed releases this package patches, in order: every release from 0.17.1 to 0.19.8."""

PATCHED_RELEASES = (
    "0.17.1", "0.17.2", "0.17.3", "0.17.4", "0.17.5", "0.17.6",
    "0.18.0", "0.18.1", "0.18.2", "0.18.3", "0.18.4", "0.18.5", "0.18.6", "0.18.7", "0.18.8", "0.18.9",
    "0.19.0", "0.19.1", "0.19.2", "0.19.3", "0.19.4", "0.19.5", "0.19.6", "0.19.7", "0.19.8",
)  # yapf: disable
