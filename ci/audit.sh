#!/usr/bin/env bash
# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
# Set up, then audit a plain training script (ci/smoke_train.py, 2 CPU ranks, ZeRO-2 with offload, `deepspeed`
# launcher) the way a training repository gates its smoke run: the patch disabled, then applied, side by side, with a
# budget of 0 host syncs in the backward passes of the patched run and of 10 per whole optimizer step. Extra
# arguments go to `ds-offload-patch audit`.
set -euo pipefail
. "$(dirname "$0")/setup.sh"
export LOCAL_SIZE=2  # the device count of DeepSpeed's CPU accelerator, which the launcher checks --num_gpus against
ds-offload-patch audit --compare --steps 2 --stop-after --max-backward-syncs 0 --max-total-syncs 10 "$@" -- \
    deepspeed --num_gpus 2 ci/smoke_train.py
