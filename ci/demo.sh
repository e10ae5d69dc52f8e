#!/usr/bin/env bash
# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
# Set up, then run the main job: a small ZeRO-2 offload run on 2 CPU ranks, unpatched and patched, side by side.
set -euo pipefail
. "$(dirname "$0")/setup.sh"
python -m deepspeed_offload_patch.demo "$@"
