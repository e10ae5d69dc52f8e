#!/usr/bin/env bash
# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
# The CUDA checks in one command, for a machine with one CUDA GPU: `ds-offload-patch verify` on
# the GPU; the benchmark's CUDA mode, unpatched vs patched vs patched with the on-device grad norm, at N = 50 and 398
# parameter tensors (398: the model size of the upstream report), in three columns: the boundary backward,
# step() and the whole optimizer step, each with the host syncs counted by the package's counter and the
# cudaStreamSynchronize / aten::item counted by torch.profiler; the host-sync counter on a CUDA run (reads of CPU
# tensors are not syncs there); the equivalence tests that run on one rank (parameters, master weights, loss scale
# and global grad norm bit-identical to unpatched, on the GPU) and the grad norm's bits against DeepSpeed's loop with
# the norms on the GPU (their patched side has every change on, the opt-in ones too); then the opt-in changes (off by
# default until this script has proven them on a GPU): the event-wait fix's tests, and ci/gpu_waits.py's host waits of one
# optimizer step by kind (reads, event waits, stream waits, device syncs, blocking copies; and the profiler's
# cudaStream/Event/DeviceSynchronize) at ZeRO-1/2/3, accumulation 1 and 2, pinned and pageable, unpatched / sync fix
# / all changes, at the same N (about 8 minutes in all). Prints the tables and one summary line; exits 1 on a failed
# check, 3 (with a message, nothing run) when there is no CUDA GPU. Uses the active Python environment, or .venv if there is one.
#
#     ci/gpu-check.sh            # run the checks
#     ci/gpu-check.sh --dry-run  # say what would run
set -uo pipefail
cd "$(dirname "$0")/.."
SIZES="50 398"
OUT=reports/gpu-check
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
PY=$(command -v python || command -v python3)
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}

if [ "${1:-}" = "--dry-run" ]; then
    echo "gpu-check: would run: ds-offload-patch verify; bench --world-size 1 --sizes $SIZES (backward, step," \
        "whole step: host syncs and CUDA sync counts); the host-sync counter on CUDA (a CPU read does not count," \
        "a CUDA read does); pytest tests/unit/v1/zero/test_offload_one_rank.py and the grad norm's bits;" \
        "test_offload_event_waits.py; ci/gpu_waits.py --sizes $SIZES (host waits" \
        "by kind, ZeRO-1/2/3, accumulation 1 and 2, pinned and pageable, unpatched / sync fix / all changes)"
    exit 0
fi

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)" \
    2>/dev/null; then
    echo "gpu-check: refused: no CUDA GPU here (torch.cuda.is_available() is False); nothing was checked"
    exit 3
fi

mkdir -p "$OUT"
failures=()

if timeout 300 "$PY" -m deepspeed_offload_patch verify > "$OUT/verify.log" 2>&1; then
    verify=ok
else
    verify=FAIL
    failures+=("verify (see $OUT/verify.log)")
fi

# shellcheck disable=SC2086
if timeout 600 "$PY" -m deepspeed_offload_patch.bench --world-size 1 --sizes $SIZES --stages 1 2 \
    --modes bf16-check --warmup 0 --steps 2 --out "$OUT" > "$OUT/bench.log" 2>&1; then
    bench=ok
else
    bench=FAIL
    failures+=("bench (see $OUT/bench.log)")
fi
sed -n '/^device: /,/^wrote /p' "$OUT/bench.log"
# From bench.json, the three columns: host syncs counted and CUDA waits, unpatched -> patched -> +grad norm.
syncs=$("$PY" - "$OUT/bench.json" <<'PY' 2>&1
import json, sys
try:
    results = json.load(open(sys.argv[1]))["results"]
except (OSError, ValueError, KeyError) as exc:
    print(f"FAIL: no benchmark results ({exc})")
    sys.exit(1)
words, bad = [], []
variants = ("unpatched", "patched", "patched+grad-norm")
whole = {}
for rows in zip(*(results[v] for v in variants)):
    un, pa, gn = rows
    where = f"ZeRO-{un['stage']} {un['mode']} N={un['n']}"
    if any("cuda" not in r for r in rows):
        bad.append(f"{where}: no CUDA counts")
        continue
    cols = []
    for phase in ("backward", "step", "whole"):
        counted = "/".join(str(r[f"{phase}_syncs_max"]) for r in rows)
        streams = "/".join(str(r["cuda"][phase]["cudaStreamSynchronize"]) for r in rows)
        cols.append(f"{phase} {counted} ({streams})")
    words.append(f"{where}: " + ", ".join(cols))
    if pa["cuda"]["backward"]["aten::item"] or gn["cuda"]["backward"]["aten::item"]:
        bad.append(f"{where}: aten::item in a patched boundary backward")
    if not pa["cuda"]["backward"]["cudaStreamSynchronize"] < un["cuda"]["backward"]["cudaStreamSynchronize"]:
        bad.append(f"{where}: the patched boundary backward does not wait less")
    whole.setdefault((un["stage"], un["mode"]), {})[un["n"]] = gn["cuda"]["whole"]["cudaStreamSynchronize"]
for (stage, mode), counts in whole.items():
    if len(set(counts.values())) > 1:
        bad.append(f"ZeRO-{stage} {mode}: the whole step's cudaStreamSynchronize with the on-device grad norm grows "
                   f"with N: {counts}")
print("host syncs unpatched/patched/+grad norm (cudaStreamSynchronize): " + "; ".join(words + [f"FAIL: {b}" for b in bad]))
sys.exit(1 if bad else 0)
PY
)
if [ $? -ne 0 ]; then
    failures+=("CUDA sync counts: $syncs")
fi

# The counter on a GPU run: a read of a CUDA tensor counts, a read of a CPU tensor (which waits for nothing) does not.
counter=$("$PY" - <<'PY' 2>&1
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

if timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/unit/v1/zero/test_offload_one_rank.py \
    "tests/unit/v1/zero/test_offload_grad_norm.py::TestGradNormBits" > "$OUT/equivalence.log" 2>&1; then
    equivalence="$(tail -1 "$OUT/equivalence.log")"
else
    equivalence="FAIL"
    failures+=("one-rank equivalence and grad norm bits (see $OUT/equivalence.log)")
fi

# The opt-in changes on the GPU (the equivalence tests above already ran with every change on: the harness's patched
# side switches each on): the event-wait fix's own tests (same bits, its waits per backward), and the host waits of
# one optimizer step by kind at ZeRO-1/2/3, accumulation 1 and 2, pinned and pageable, unpatched / sync fix / all
# changes (waits.json).
if timeout 600 "$PY" -m pytest -q -p no:cacheprovider tests/unit/v1/zero/test_offload_event_waits.py \
    > "$OUT/opt-in.log" 2>&1; then
    opt_in_tests="$(tail -1 "$OUT/opt-in.log")"
else
    opt_in_tests="FAIL"
    failures+=("the event-wait fix's tests (see $OUT/opt-in.log)")
fi
# shellcheck disable=SC2086
if timeout 900 "$PY" ci/gpu_waits.py --sizes $SIZES --out "$OUT" > "$OUT/waits.log" 2>&1; then
    waits=ok
else
    waits=FAIL
    failures+=("host waits by kind (see $OUT/waits.log)")
fi
sed -n '/^DeepSpeed /,/^wrote /p' "$OUT/waits.log"

summary="gpu-check on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1): verify $verify;"
summary+=" bench $bench: $syncs; $counter; equivalence and grad norm bits: $equivalence;"
summary+=" the event-wait fix's tests: $opt_in_tests; host waits by kind: $waits"
if [ ${#failures[@]} -gt 0 ]; then
    echo "$summary; FAILED: ${failures[*]}"
    exit 1
fi
echo "$summary"
