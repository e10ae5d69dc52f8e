#!/usr/bin/env bash
# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
# Build the sdist and, from it, the wheel (python -m build), check both with twine, install that wheel into a fresh virtualenv with torch
# 2.13.0 and DeepSpeed, and run the CLI there from outside the checkout: status, check, diff (the diffs must have
# come with the wheel) and verify. Exits non-zero on any failure.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
. "$ROOT/ci/setup.sh"
cd "$ROOT"
rm -rf dist
python -m build --outdir dist
sdist=$(ls dist/*.tar.gz)
wheel=$(ls dist/*.whl)
# The metadata and README render as an index would show them.
python -m twine check --strict dist/*.tar.gz dist/*.whl
# (Listings are grepped as files: grep -q on a pipe would end the lister early, which pipefail reports.)
tar tzf "$sdist" > dist/sdist.txt
grep -q "/patches/index.json$" dist/sdist.txt || { echo "the sdist holds no patches/"; exit 1; }
python -m zipfile -l "$wheel" > dist/wheel.txt
grep -q "deepspeed_offload_patch/_patches/index.json" dist/wheel.txt || { echo "the wheel holds no diffs"; exit 1; }

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install --quiet "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$WORK/venv/bin/python" -m pip install --quiet "$ROOT/$wheel"
cd "$WORK"  # no checkout on the path
export TORCH_EXTENSIONS_DIR="$WORK/torch_extensions"
ds="$WORK/venv/bin/ds-offload-patch"
"$WORK/venv/bin/python" -c "import deepspeed_offload_patch, sys; assert '$ROOT' not in deepspeed_offload_patch.__file__, deepspeed_offload_patch.__file__"
"$ds" status
"$ds" check
"$ds" diff > fix.diff
grep -q "^+++ b/deepspeed/runtime/zero/stage_1_and_2.py" fix.diff
"$ds" verify
echo "package: the wheel built from $(basename "$sdist") installs and works: status, check, diff, verify"
