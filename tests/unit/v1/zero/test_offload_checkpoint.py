# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Checkpoints cross the patch both ways: saved with it and loaded without it, or the reverse, mid-training, the run
continues bit-identically to one that was never interrupted, and the saved files have the same types everywhere
(no tensor where DeepSpeed saves a bool).

Three 2-rank jobs: patched (trains, saves after step 3), unpatched (trains, saves, and resumes from the patched
checkpoint), patched again (resumes from the unpatched checkpoint). Each run has an overflow at step 1, so the
checkpoint carries a skipped step.
"""

import glob
import os

import pytest
import torch

from deepspeed_offload_patch.testing.equivalence import (CHECKPOINT_TAG, PATCHED, UNPATCHED, Fault, Run, differences,
                                                         flag_is_read, run_side)

pytestmark = pytest.mark.equivalence

SAVE_AFTER = 3
# ZeRO-1 in bf16 where step() reads its flag (from DeepSpeed 0.17.1; fp16 before), ZeRO-2 in fp16, whose dynamic
# loss scale state the checkpoint also carries.
RUNS = tuple(
    Run(f"checkpoint-{precision}-s{stage}",
        stage=stage,
        precision=precision,
        grad_accum=2,
        steps=6,
        save_after=SAVE_AFTER,
        faults=(Fault(1, "inf"), ))
    for stage, precision in ((1, "bf16" if flag_is_read("bf16") else "fp16"), (2, "fp16")))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    roots = {side: str(tmp_path_factory.mktemp(f"saved-{side}")) for side in (PATCHED, UNPATCHED)}
    patched = run_side(PATCHED, RUNS, save_root=roots[PATCHED])
    unpatched = run_side(UNPATCHED, RUNS, save_root=roots[UNPATCHED], load_root=roots[PATCHED])
    patched_resumed = run_side(PATCHED, RUNS, load_root=roots[UNPATCHED])
    return {"patched": patched, "unpatched": unpatched, "patched_resumed": patched_resumed, "roots": roots}


def _leaf_types(value, path="") -> dict:
    """``{path: type name}`` for every leaf of a loaded checkpoint (dicts, sequences and objects' attributes)."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    elif hasattr(value, "__dict__") and not torch.is_tensor(value) and not isinstance(value, type):
        items = vars(value).items()
    else:
        return {path: "Tensor" if torch.is_tensor(value) else type(value).__name__}
    found = {}
    for key, item in items:
        found.update(_leaf_types(item, f"{path}/{key}"))
    return found


def _saved_files(root: str, run: Run) -> dict:
    folder = os.path.join(root, run.name, CHECKPOINT_TAG)
    return {os.path.basename(p): p for p in sorted(glob.glob(os.path.join(folder, "*.pt")))}


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_saved_with_the_patch_resumes_without_it(jobs, run):
    resumed = jobs["unpatched"]
    assert resumed[0]["resumed"][run.name]["first"] == SAVE_AFTER
    found = differences(resumed, jobs["unpatched"], run.name, part="resumed", b_part="runs", from_step=SAVE_AFTER)
    found += differences(resumed, jobs["patched"], run.name, part="resumed", b_part="runs", from_step=SAVE_AFTER)
    assert not found, "\n".join(found[:10])
    assert resumed[0]["resumed"][run.name]["steps"][0]["skipped"] == 1, "the skipped step came with the checkpoint"


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_saved_without_the_patch_resumes_with_it(jobs, run):
    resumed = jobs["patched_resumed"]
    assert resumed[0]["state"] in ("applied", "upstream-fixed")
    found = differences(resumed, jobs["patched"], run.name, part="resumed", b_part="runs", from_step=SAVE_AFTER)
    found += differences(resumed, jobs["unpatched"], run.name, part="resumed", b_part="runs", from_step=SAVE_AFTER)
    assert not found, "\n".join(found[:10])


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_saved_state_has_the_same_types_with_and_without_the_patch(jobs, run):
    patched = _saved_files(jobs["roots"][PATCHED], run)
    unpatched = _saved_files(jobs["roots"][UNPATCHED], run)
    assert patched and patched.keys() == unpatched.keys(), (sorted(patched), sorted(unpatched))
    bools = 0
    for name, path in patched.items():
        with_patch = _leaf_types(torch.load(path, map_location="cpu", weights_only=False))
        without = _leaf_types(torch.load(unpatched[name], map_location="cpu", weights_only=False))
        assert with_patch == without, {
            k: (with_patch.get(k), without.get(k))
            for k in with_patch.keys() | without.keys() if with_patch.get(k) != without.get(k)
        }
        bools += sum(kind == "bool" for kind in without.values())
        assert not any(key.endswith("/overflow") and kind != "bool" for key, kind in with_patch.items()), name
    assert bools, "the unpatched checkpoint has bool fields (such as the optimizer's overflow) to compare"
