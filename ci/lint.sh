#!/usr/bin/env bash
# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
# Style checks, as DeepSpeed runs them on its own code: yapf (.style.yapf), flake8 (.flake8), codespell, and an
# SPDX Apache-2.0 header on every source file. Exits non-zero on any finding.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
mapfile -t py < <(git ls-files '*.py')
mapfile -t sources < <(git ls-files '*.py' '*.sh' '*.yml' '*.yaml' '.ci/run')

echo "== yapf"
if ! out=$(yapf --diff "${py[@]}") || [ -n "$out" ]; then echo "$out"; echo "yapf: run yapf -i on the files above"; status=1; fi
echo "== flake8"
flake8 "${py[@]}" || status=1
echo "== codespell"
codespell $(git ls-files '*.py' '*.md' '*.sh' '*.cfg' '*.ini' '*.toml' '*.yml' '*.yaml' 'ci/*' '.ci/*') || status=1
echo "== SPDX headers"
for f in "${sources[@]}"; do
    if ! head -5 "$f" | grep -q 'SPDX-License-Identifier: Apache-2.0'; then echo "missing SPDX header: $f"; status=1; fi
done
[ $status -eq 0 ] && echo "lint: clean"
exit $status
