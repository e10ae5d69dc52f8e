# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The host waits of one optimizer step, by kind, for the offload jobs that wait per tensor on a GPU (``ci/gpu-check.sh``
runs it; on the CPU it runs too, with DeepSpeed's own wait points standing for the device's).

For ZeRO-1, 2 and 3 with ``offload_optimizer``, gradient accumulation 1 and 2, pinned and pageable CPU buffers
(``pin_memory``), N = 50 and 398 parameter tensors (``--sizes``), bf16: each variant (unpatched; the sync fix alone,
``DS_OFFLOAD_PATCH_UPSTREAM_ONLY=1``; every change, the opt-in ones too) trains one step untimed, then one optimizer
step under the package's counter (reads, event waits, stream waits, device syncs, blocking copies) and, on CUDA, one
under ``torch.profiler`` (``cudaStreamSynchronize``, ``cudaEventSynchronize``, ``cudaDeviceSynchronize``), each variant
in its own process on one rank.

Prints one table row per job; writes ``waits.json`` to ``--out``. Exits 1 when the parameters after the steps differ
between the variants (they must be bit-identical: no inf/NaN, accumulation under 3), or when with every change on a
pinned ZeRO-1/2 job's waits of some kind differ between the sizes (what the changes must remove); the waits that a setting or a
release removes (``affected`` lists them: pageable buffers, ZeRO-3's copies up to 0.19.4) are shown, not judged.

    python ci/gpu_waits.py [--sizes 50 398] [--out reports/gpu-check]
"""

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from deepspeed_offload_patch import settings  # noqa: E402
from deepspeed_offload_patch.changes import CHANGES  # noqa: E402
from deepspeed_offload_patch.waits import KINDS  # noqa: E402

VARIANTS = {
    "unpatched": {
        settings.DISABLE: "1"
    },
    "sync-fix": {
        settings.DISABLE: "0",
        settings.UPSTREAM_ONLY: "1"
    },
    "all-changes": {
        settings.DISABLE: "0",
        settings.UPSTREAM_ONLY: "0",
        **{
            change.switch: "1"
            for change in CHANGES if change.opt_in
        }
    },
}
PROFILED = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")  # of bench.CUDA_EVENTS
JOBS = [(stage, accum, pin) for stage in (1, 2, 3) for accum in (1, 2) for pin in (True, False)]


def _step(engine, step: int, accum: int) -> None:
    from deepspeed_offload_patch.testing.models import batch, optimizer_step

    for micro in range(accum):
        engine.backward(engine(batch(engine, step * accum + micro)).float().pow(2).mean())
        optimizer_step(engine)


def _job(stage: int, accum: int, pin: bool, tensors: int) -> Dict[str, Any]:
    import torch

    from deepspeed_offload_patch.hostsync import count_host_syncs
    from deepspeed_offload_patch.testing.models import ds_config, make_engine

    config = ds_config(stage=stage, dtype="bf16", grad_accum=accum)
    config["zero_optimization"]["offload_optimizer"]["pin_memory"] = pin
    engine = make_engine(num_tensors=tensors, config=config)
    _step(engine, 0, accum)
    with count_host_syncs() as counted:
        _step(engine, 1, accum)
    row: Dict[str, Any] = {"counted": counted.by_kind}
    if engine.device.type == "cuda":
        from deepspeed_offload_patch.bench import _cuda_sync_events  # the benchmark's profiled count of the waits

        torch.cuda.synchronize()
        row["profiled"] = _cuda_sync_events(lambda: _step(engine, 2, accum))
    else:
        _step(engine, 2, accum)
    row["params"] = [p.detach().float().cpu() for p in engine.module.parameters()]
    return row


def _variant(sizes: List[int]) -> Dict[str, Any]:
    import deepspeed

    import deepspeed_offload_patch

    status = deepspeed_offload_patch.status()
    rows = {f"{stage}-{accum}-{pin}-{n}": _job(stage, accum, pin, n) for stage, accum, pin in JOBS for n in sizes}
    return {
        "deepspeed": deepspeed.__version__,
        "states": {
            c.name: str(status.of(c)[0])
            for c in CHANGES
        },
        "rows": rows
    }


def _cell(found: Dict[str, Any]) -> str:
    counted = "/".join(str(found["counted"][kind]) for kind in KINDS)
    profiled = "/".join(str(found["profiled"][key]) for key in PROFILED) if "profiled" in found else "-"
    return f"{counted} ({profiled})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 398], help="parameter tensors (default 50 398)")
    parser.add_argument("--out", default=os.path.join("reports", "gpu-check"), help="folder for waits.json")
    args = parser.parse_args(argv)
    import torch

    from deepspeed_offload_patch.testing.launch import run_distributed

    found = {
        variant: run_distributed(_variant, 1, args=(args.sizes, ), env=env, timeout=3600)[0]
        for variant, env in VARIANTS.items()
    }
    print(f"DeepSpeed {found['unpatched']['deepspeed']}; per optimizer step, counted "
          f"{'/'.join(KINDS)} (profiled {'/'.join(PROFILED)}); {' | '.join(VARIANTS)}")
    bad = []
    growth: Dict[Tuple[int, int, bool], Dict[int, Tuple[int, ...]]] = {}
    for stage, accum, pin in JOBS:
        for n in args.sizes:
            key = f"{stage}-{accum}-{pin}-{n}"
            rows = [found[variant]["rows"][key] for variant in VARIANTS]
            print(f"ZeRO-{stage} accumulation {accum} {'pinned' if pin else 'pageable'} N={n}: " +
                  " | ".join(_cell(row) for row in rows))
            if not all(
                    all(torch.equal(a, b) for a, b in zip(rows[0]["params"], row["params"], strict=True))
                    for row in rows[1:]):
                bad.append(f"{key}: the parameters differ between the variants")
            growth.setdefault((stage, accum, pin), {})[n] = tuple(rows[-1]["counted"].values())
    for (stage, accum, pin), by_n in growth.items():
        if stage in (1, 2) and pin and len(set(by_n.values())) > 1:
            bad.append(
                f"ZeRO-{stage} accumulation {accum} pinned: with every change on, the waits differ with N: {by_n}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "waits.json"), "w") as f:
        json.dump(
            {
                variant: {
                    **{
                        k: v
                        for k, v in data.items() if k != "rows"
                    }, "rows": {
                        key: {
                            k: v
                            for k, v in row.items() if k != "params"
                        }
                        for key, row in data["rows"].items()
                    }
                }
                for variant, data in found.items()
            },
            f,
            indent=1)
    for line in bad:
        print(f"FAIL: {line}")
    print(f"wrote {os.path.join(args.out, 'waits.json')}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
