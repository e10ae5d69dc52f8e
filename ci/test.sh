#!/usr/bin/env bash
# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
# Set up, then run the checks: style, the test suite with the patch, and the red/green proof (the suite again with
# the patch disabled must fail exactly the tests marked fails_unpatched). Exits non-zero on any failure.
set -euo pipefail
. "$(dirname "$0")/setup.sh"
ci/lint.sh
python -m pytest -q --junitxml=reports/patched.xml "$@"
python ci/check_red_green.py "$@"
