# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""``python -m deepspeed_offload_patch``: the same as ``ds-offload-patch``."""

import sys

from deepspeed_offload_patch.cli import main

sys.exit(main())
