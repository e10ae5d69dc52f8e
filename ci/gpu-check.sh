#!/usr/bin/env bash
# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
# The CUDA checks in one command, for a machine with one CUDA GPU (about 3 minutes): `ds-offload-patch verify` on
# the GPU; the benchmark's CUDA mode, unpatched vs patched, at N = 398 parameter tensors (the model size of the
# upstream report), with cudaStreamSynchronize and aten::item counted by torch.profiler in the boundary backward;
# the host-sync counter on a CUDA run (reads of CPU tensors are not syncs there); and the equivalence tests that run on
# one rank. Prints one summary line; exits 1 on a failed check, 3 (with a
# message, nothing run) when there is no CUDA GPU. Uses the active Python environment, or .venv if there is one.
#
#     ci/gpu-check.sh            # run the checks
#     ci/gpu-check.sh --dry-run  # say what would run
set -uo pipefail
cd "$(dirname "$0")/.."
N=398
OUT=reports/gpu-check
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}

if [ "${1:-}" = "--dry-run" ]; then
    echo "gpu-check: would run: ds-offload-patch verify; bench --world-size 1 --sizes $N (CUDA sync counts);" \
        "the host-sync counter on CUDA (a CPU read does not count, a CUDA read does);" \
        "pytest tests/unit/v1/zero/test_offload_one_rank.py"
    exit 0
fi

if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)" \
    2>/dev/null; then
    echo "gpu-check: refused: no CUDA GPU here (torch.cuda.is_available() is False); nothing was checked"
    exit 3
fi

mkdir -p "$OUT"
failures=()

if timeout 300 python -m deepspeed_offload_patch verify > "$OUT/verify.log" 2>&1; then
    verify=ok
else
    verify=FAIL
    failures+=("verify (see $OUT/verify.log)")
fi

if timeout 600 python -m deepspeed_offload_patch.bench --world-size 1 --sizes $N --stages 1 2 --modes bf16-check \
    --warmup 1 --steps 2 --out "$OUT" > "$OUT/bench.log" 2>&1; then
    bench=ok
else
    bench=FAIL
    failures+=("bench (see $OUT/bench.log)")
fi
# From bench.json: the boundary backward's CUDA syncs, unpatched -> patched, per stage.
syncs=$(python - "$OUT/bench.json" "$N" <<'PY' 2>&1
import json, sys
path, n = sys.argv[1], int(sys.argv[2])
try:
    results = json.load(open(path))["results"]
except (OSError, ValueError, KeyError) as exc:
    print(f"FAIL: no benchmark results ({exc})")
    sys.exit(1)
words, bad = [], []
for un, pa in zip(results["unpatched"], results["patched"]):
    u, p = un.get("cuda"), pa.get("cuda")
    if u is None or p is None:
        bad.append(f"stage {un['stage']}: no CUDA counts")
        continue
    words.append(f"ZeRO-{un['stage']} N={un['n']} cudaStreamSynchronize {u['cudaStreamSynchronize']}->"
                 f"{p['cudaStreamSynchronize']} aten::item {u['aten::item']}->{p['aten::item']}")
    if p["aten::item"] != 0 or u["aten::item"] < n or p["cudaStreamSynchronize"] >= u["cudaStreamSynchronize"]:
        bad.append(f"stage {un['stage']}: unexpected counts")
print("; ".join(words + [f"FAIL: {b}" for b in bad]))
sys.exit(1 if bad else 0)
PY
)
if [ $? -ne 0 ]; then
    failures+=("CUDA sync counts: $syncs")
fi

# The counter on a GPU run: a read of a CUDA tensor counts, a read of a CPU tensor (which waits for nothing) does not.
counter=$(python - <<'PY' 2>&1
import sys, torch
from deepspeed_offload_patch.hostsync import count_host_syncs, run_device_type
with count_host_syncs() as cpu_read:
    torch.tensor(1.0).item()
with count_host_syncs() as cuda_read:
    torch.tensor(1.0, device="cuda").item()
print(f"counter on {run_device_type()}: a CPU tensor's .item() {cpu_read.total} (expected 0), a CUDA tensor's "
      f"{cuda_read.total} (expected 1)")
sys.exit(0 if (cpu_read.total, cuda_read.total) == (0, 1) else 1)
PY
)
if [ $? -ne 0 ]; then
    failures+=("host-sync counter on CUDA: $counter")
fi

if timeout 600 python -m pytest -q -p no:cacheprovider tests/unit/v1/zero/test_offload_one_rank.py \
    > "$OUT/equivalence.log" 2>&1; then
    equivalence="$(tail -1 "$OUT/equivalence.log")"
else
    equivalence="FAIL"
    failures+=("one-rank equivalence (see $OUT/equivalence.log)")
fi

summary="gpu-check: verify $verify; bench $bench: $syncs; $counter; equivalence: $equivalence"
if [ ${#failures[@]} -gt 0 ]; then
    echo "$summary; FAILED: ${failures[*]}"
    exit 1
fi
echo "$summary"
