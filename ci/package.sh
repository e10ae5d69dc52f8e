#!/usr/bin/env bash
# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
# The release, rehearsed on a real index. check-manifest: the sdist holds every file git has (MANIFEST.in). Build the
# sdist and, from it, the wheel (python -m build) into dist/, which then holds only those two; twine check --strict
# (the long description renders as the index shows it, with no link into the checkout). Then the release's upload
# command, `python -m twine upload dist/*`, to a pypiserver started here for the run, and in a fresh virtualenv that
# already has torch 2.13.0: `pip install deepspeed-offload-patch==VERSION` by name, from that index (pip's report must
# show the wheel came from it), and the CLI from outside the checkout: status, check, diff (the diffs came with the
# wheel), verify. Exits non-zero on any failure.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
. "$ROOT/ci/setup.sh"
cd "$ROOT"
WORK=$(mktemp -d)
SERVER=""
trap '[ -z "$SERVER" ] || kill "$SERVER" 2> /dev/null; rm -rf "$WORK"' EXIT
VERSION=$(python -c "import re; print(re.search(r'^__version__ = \"([^\"]+)\"', open('deepspeed_offload_patch/__init__.py').read(), re.M).group(1))")

python -m check_manifest
rm -rf dist
python -m build --outdir dist
sdist=$(ls dist/*.tar.gz)
wheel=$(ls dist/*.whl)
python -m twine check --strict dist/*
# (Listings are grepped as files: grep -q on a pipe would end the lister early, which pipefail reports.)
tar tzf "$sdist" > "$WORK/sdist.txt"
for path in patches/overflow-flag/index.json docs/audit.md ci/templates/ds_config_smoke.json pytest.ini; do
    grep -q "/$path$" "$WORK/sdist.txt" || { echo "the sdist holds no $path"; exit 1; }
done
python -m zipfile -l "$wheel" > "$WORK/wheel.txt"
grep -q "deepspeed_offload_patch/_patches/overflow-flag/index.json" "$WORK/wheel.txt" || { echo "the wheel holds no diffs"; exit 1; }
# The index page: every link in the long description is absolute (a relative one points into a checkout).
python - "$wheel" << 'PY'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as whl:
    metadata = next(whl.read(name).decode() for name in whl.namelist() if name.endswith(".dist-info/METADATA"))
relative = re.findall(r"\]\((?!https?://|mailto:)([^)\s]+)\)", metadata)
assert not relative, f"the long description links into the checkout: {relative}"
PY

# The rehearsal: upload to a local index, then install by name from it.
mkdir "$WORK/index"
PORT=$(python -c "from deepspeed_offload_patch.testing.launch import free_port; print(free_port())")
URL="http://127.0.0.1:$PORT"
python -m pypiserver run --interface 127.0.0.1 --port "$PORT" --authenticate . --passwords . --log-stream none \
    "$WORK/index" &
SERVER=$!
# Up when it answers; a server that died fails the run (no fixed wait a slow machine could outlast).
until python -c "import urllib.request; urllib.request.urlopen('$URL/simple/')" 2> /dev/null; do
    kill -0 "$SERVER" 2> /dev/null || { echo "pypiserver exited"; exit 1; }
    sleep 1
done
# The release's own command (ci/README, Releasing), with the index and its (unchecked) credentials from the environment.
TWINE_REPOSITORY_URL="$URL/" TWINE_USERNAME=rehearsal TWINE_PASSWORD=rehearsal TWINE_NON_INTERACTIVE=1 \
    python -m twine upload dist/*
python3 -m venv "$WORK/venv"
# The pinned test environment (ci/constraints.txt): the DeepSpeed the transcripts below were written for.
"$WORK/venv/bin/python" -m pip install --quiet -c "$ROOT/ci/constraints.txt" "torch==2.13.0" \
    ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$WORK/venv/bin/python" -m pip install --quiet -c "$ROOT/ci/constraints.txt" --extra-index-url "$URL/simple/" \
    --report "$WORK/install.json" \
    "deepspeed-offload-patch==$VERSION"
python - "$WORK/install.json" "$URL" << 'PY'
import json, sys
report, url = json.load(open(sys.argv[1])), sys.argv[2]
ours = [item["download_info"]["url"] for item in report["install"] if item["metadata"]["name"] == "deepspeed-offload-patch"]
assert ours and ours[0].startswith(url) and ours[0].endswith(".whl"), f"not the rehearsal index's wheel: {ours}"
print(f"package: installed by name from the rehearsal index: {ours[0]}")
PY
cd "$WORK"  # no checkout on the path
export TORCH_EXTENSIONS_DIR="$WORK/torch_extensions"
ds="$WORK/venv/bin/ds-offload-patch"
"$WORK/venv/bin/python" -c "import deepspeed_offload_patch, sys; assert '$ROOT' not in deepspeed_offload_patch.__file__, deepspeed_offload_patch.__file__"
"$ds" status
"$ds" check
"$ds" diff > fix.diff
grep -q "^+++ b/deepspeed/runtime/zero/stage_1_and_2.py" fix.diff
"$ds" verify
echo "package: $(basename "$wheel"), built from $(basename "$sdist"), uploaded to a local index and installed from it by name: status, check, diff, verify"
