#!/usr/bin/env bash
# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
# Source me: creates (or reuses) the virtualenv $VENV (default .venv) and installs torch 2.13.0 first (a bare
# `pip install deepspeed` would pull a multi-GB CUDA torch), then this package with its dev tools.
# TORCH_INDEX_URL (unset by default): the index torch comes from. On an ordinary Linux machine PyPI's torch 2.13.0 is
# a CUDA build of several GB; TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu gives the CPU build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# ci/constraints.txt pins every version the tests install (ci/pin.py writes it): a release published upstream changes
# nothing here until the file is updated on purpose (ci/README.md, "The pinned test environment").
python -m pip install --quiet -c ci/constraints.txt "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
python -m pip install --quiet -c ci/constraints.txt -e ".[dev]"
# A venv made before the pins changed keeps its old versions: say so, and which, rather than test with them.
python ci/pin.py --verify || { echo "ci/setup.sh: $VENV differs from ci/constraints.txt: remove $VENV and run again"; exit 1; }
# DeepSpeed JIT-builds ops into here; keep them out of the home directory of a shared machine.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
# DeepSpeed's CPU shm comm op, built now in this one process: no multi-rank job is then the first to need it (two
# ranks that both find it unbuilt race to build it, and on a loaded machine one loads it before it is written).
python -m deepspeed_offload_patch.cpu_shm build
