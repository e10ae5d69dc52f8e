# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""``ds-offload-patch affected CONFIG``: which defects a job has, from its DeepSpeed config, and whether the package
fixes each here. The configs in ``configs/`` are the ones users pass or their libraries generate: the upstream report's
(ZeRO-1, CPU offload, bf16, fp32 gradient accumulation), the ZeRO-2 offload file in the shape of HF's DeepSpeed guide
with its ``"auto"`` values, and, written by ``ci/gen_configs.py`` with the transformers and accelerate of
``generated-with.json``, what HF Trainer makes of that file and what Accelerate generates for ``accelerate launch
--use_deepspeed --zero_stage 2 --offload_optimizer_device cpu --mixed_precision bf16`` (its ``steps_per_print`` is
infinite). ``tests/stacks/test_stacks.py`` checks that those two are what the libraries generate."""

import dataclasses
import json
import os

import pytest

from deepspeed_offload_patch import one_inf
from deepspeed_offload_patch.affected import findings, read_job
from deepspeed_offload_patch.changes import by_name
from deepspeed_offload_patch.patcher import PatchStatus
from unit.common import run_command
from unit.test_cli import CLI

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
UPSTREAM = os.path.join(CONFIGS, "upstream_report.json")
HF = os.path.join(CONFIGS, "hf_trainer_zero2_offload.json")
ACCELERATE = os.path.join(CONFIGS, "accelerate_generated_zero2_offload.json")
HF_GENERATED = os.path.join(CONFIGS, "hf_trainer_generated_zero2_offload.json")


def _config(path, **changes):
    with open(path) as f:
        config = json.load(f)
    for dotted, value in changes.items():
        where = config
        *parents, last = dotted.split("__")
        for key in parents:
            where = where.setdefault(key, {})
        where[last] = value
    return config


def _status(state="applied",
            skipped_step="applied",
            grad_norm="applied",
            version="0.19.8",
            grad_accumulation="not-needed",
            several_backwards="not-needed",
            zero3_overflow="not-needed",
            invalid_norm="not-needed",
            rank_agreement="not-needed",
            bf16_check="not-needed",
            event_waits="off"):
    return PatchStatus(state, version, "", {}, {
        "grad-norm": (grad_norm, ""),
        "skipped-step": (skipped_step, ""),
        "grad-accumulation": (grad_accumulation, ""),
        "several-backwards": (several_backwards, ""),
        "zero3-overflow": (zero3_overflow, ""),
        "invalid-norm": (invalid_norm, ""),
        "rank-agreement": (rank_agreement, ""),
        "bf16-check": (bf16_check, ""),
        "event-waits": (event_waits, "")
    })


def _verdicts(config, status):
    return {f.defect: (f.affected, f.fixed) for f in findings(read_job(config), status)}


def test_the_upstream_report_s_job_has_both_defects_and_both_are_fixed():
    assert _verdicts(_config(UPSTREAM), _status()) == {
        "host-sync": ("yes", "yes"),
        "skipped-step": ("yes", "yes"),
        "step-reads": ("yes", "yes"),
        "dropped-micro-batches": ("no", "-"),
        "dropped-backwards": ("no", "-"),
        "invalid-norm": ("no", "-"),
        "bf16-unchecked": ("no", "-"),
        "ranks-disagree": ("no", "-"),
        "zero3-nan-weights": ("no", "-"),
        "per-tensor-waits": ("no", "-"),
    }
    # Unpatched, or with the skipped-step fix off, the defects stay.
    assert _verdicts(_config(UPSTREAM), _status("disabled", "off"))["skipped-step"] == ("yes", "no")
    assert _verdicts(_config(UPSTREAM), _status("applied", "off"))["host-sync"] == ("yes", "yes")
    # With the on-device grad norm switched off, step()'s reads stay.
    assert _verdicts(_config(UPSTREAM), _status(grad_norm="off"))["step-reads"] == ("yes", "no")
    # On DeepSpeed 0.19.7 there is no compact buffer: no freeze.
    assert _verdicts(_config(UPSTREAM), _status(skipped_step="not-needed",
                                                version="0.19.7"))["skipped-step"][0] == "no"


def test_hf_trainer_s_auto_precision_is_a_maybe_where_it_decides():
    job = read_job(_config(HF))
    assert (job.stage, job.offload, job.precision) == (2, "cpu", "auto")
    assert _verdicts(_config(HF), _status())["skipped-step"] == ("no", "-")  # accumulation in the precision's dtype
    with_fp32 = _config(HF, data_types__grad_accum_dtype="fp32")
    assert _verdicts(with_fp32, _status())["skipped-step"] == ("maybe", "yes")
    assert _verdicts(with_fp32, _status("disabled", "off"))["skipped-step"] == ("maybe", "no")


@pytest.mark.parametrize("path", [HF_GENERATED, ACCELERATE], ids=["hf-trainer", "accelerate"])
def test_the_libraries_generated_configs_read_as_the_jobs_they_run(path):
    """bf16 resolved from ``"auto"`` or the launcher's flag, ZeRO-2, CPU offload: the host syncs and the step's reads,
    no freeze (accumulation in bf16) unless the job asks for fp32 accumulation."""
    job = read_job(_config(path))
    assert (job.stage, job.offload, job.precision, job.grad_accum_dtype) == (2, "cpu", "bf16", None), job
    assert _verdicts(_config(path), _status()) == {
        "host-sync": ("yes", "yes"),
        "skipped-step": ("no", "-"),
        "step-reads": ("yes", "yes"),
        "dropped-micro-batches": ("no", "-"),
        "dropped-backwards": ("no", "-"),
        "invalid-norm": ("no", "-"),
        "bf16-unchecked": ("no", "-"),
        "ranks-disagree": ("no", "-"),
        "zero3-nan-weights": ("no", "-"),
        "per-tensor-waits": ("yes", "no"),  # accumulating ZeRO-2 on 0.19.8: the opt-in event-wait fix is off
    }
    assert _verdicts(_config(path), _status("disabled", "off"))["host-sync"] == ("yes", "no")
    assert _verdicts(_config(path, data_types__grad_accum_dtype="fp32"), _status())["skipped-step"] == ("yes", "yes")


def test_accumulation_over_3_micro_steps_or_several_backwards_on_a_release_with_the_defect():
    """ZeRO-2 at ``gradient_accumulation_steps`` 4 drops micro-batches where the release has the defect (the fix then
    applied: fixed; switched off or unpatched: not); accumulation 1 may lose backwards (the config cannot say how
    many a step takes); on a release whose code is right (``not-needed``) neither."""
    ga4 = _config(UPSTREAM, zero_optimization__stage=2, gradient_accumulation_steps=4)
    old = dict(version="0.17.6", grad_accumulation="applied", several_backwards="applied", skipped_step="not-needed")
    assert _verdicts(ga4, _status(**old))["dropped-micro-batches"] == ("yes", "yes")
    assert _verdicts(ga4, _status(**dict(old, grad_accumulation="off")))["dropped-micro-batches"] == ("yes", "no")
    assert _verdicts(ga4, _status(**old))["dropped-backwards"][0] == "no"
    assert _verdicts(ga4, _status())["dropped-micro-batches"][0] == "no"  # 0.19.8: not-needed
    assert _verdicts(_config(UPSTREAM, zero_optimization__stage=1, gradient_accumulation_steps=4),
                     _status(**old))["dropped-micro-batches"][0] == "no"  # ZeRO-1 reduces once, at the boundary
    ga1 = _config(UPSTREAM, zero_optimization__stage=2, gradient_accumulation_steps=1)
    assert _verdicts(ga1, _status(**old))["dropped-backwards"] == ("maybe", "yes")
    assert _verdicts(_config(UPSTREAM, zero_optimization__stage=1, gradient_accumulation_steps=1),
                     _status(**old))["dropped-backwards"][0] == "no"  # ZeRO-1: every backward reaches the boundary
    unpatched = _status("disabled",
                        "off",
                        version="0.17.6",
                        grad_accumulation="disabled",
                        several_backwards="disabled")
    assert _verdicts(ga1, unpatched)["dropped-backwards"] == ("maybe", "no")
    assert read_job(_config(HF_GENERATED)).grad_accum == 2


def test_jobs_without_zero_1_2_offload_or_with_a_check_that_never_skips_are_not_affected():
    no_offload = _config(ACCELERATE, zero_optimization__offload_optimizer__device="none")
    assert {v[0] for v in _verdicts(no_offload, _status("disabled", "off")).values()} == {"no"}
    zero3 = _config(UPSTREAM, zero_optimization__stage=3)
    assert {v[0] for v in _verdicts(zero3, _status("disabled", "off")).values()} == {"no"}
    check_off = _config(UPSTREAM, bf16__check_grad_overflow=False)
    assert _verdicts(check_off, _status("disabled", "off"))["skipped-step"][0] == "no"
    fp16 = _config(UPSTREAM, bf16__enabled=False, fp16__enabled=True)
    assert _verdicts(fp16, _status("disabled", "off"))["skipped-step"] == ("yes", "no")


def test_an_offloaded_zero3_job_in_bf16_or_fp32_has_the_nan_weights_defect_where_the_release_has_it():
    """ZeRO-3 with ``offload_optimizer`` on 0.14.0 - 0.19.7: bf16 (whatever its check says: ZeRO-3 never reads it)
    and fp32 apply an inf step, fixed where the ZeRO-3 overflow fix is applied; fp16 checks every step; 0.19.8 skips
    (``not-needed``); the ZeRO-1/2 defects are not this job's."""
    old = dict(version="0.16.9", skipped_step="not-needed", zero3_overflow="applied")
    zero3 = _config(UPSTREAM, zero_optimization__stage=3)
    verdicts = _verdicts(zero3, _status(**old))
    assert verdicts["zero3-nan-weights"] == ("yes", "yes")
    assert {verdict[0] for defect, verdict in verdicts.items() if defect != "zero3-nan-weights"} == {"no"}
    check_off = _config(UPSTREAM, zero_optimization__stage=3, bf16__check_grad_overflow=False)
    assert _verdicts(check_off, _status(**old))["zero3-nan-weights"] == ("yes", "yes")
    fp32 = _config(UPSTREAM, zero_optimization__stage=3, bf16__enabled=False)
    assert _verdicts(fp32, _status(**dict(old, zero3_overflow="off")))["zero3-nan-weights"] == ("yes", "no")
    fp16 = _config(UPSTREAM, zero_optimization__stage=3, bf16__enabled=False, fp16__enabled=True)
    assert _verdicts(fp16, _status(**old))["zero3-nan-weights"][0] == "no"
    assert _verdicts(zero3, _status())["zero3-nan-weights"][0] == "no"  # 0.19.8: not-needed
    no_offload = _config(UPSTREAM, zero_optimization__stage=3, zero_optimization__offload_optimizer__device="none")
    assert _verdicts(no_offload, _status(**old))["zero3-nan-weights"][0] == "no"


def test_upstream_s_own_fix_means_not_affected():
    verdicts = _verdicts(_config(UPSTREAM), _status("upstream-fixed", "upstream-fixed", version="0.20.0"))
    assert verdicts["host-sync"][0] == "no" and verdicts["skipped-step"][0] == "no"


@pytest.mark.parametrize("env, code", [({}, 0), ({
    "DS_OFFLOAD_PATCH_SKIPPED_STEP": "0"
}, 1), ({
    "DS_OFFLOAD_PATCH_GRAD_NORM": "0"
}, 1), ({
    "DS_OFFLOAD_PATCH_DISABLE": "1"
}, 1)])
def test_the_command_s_exit_code_is_a_gate(env, code):
    """On the installed DeepSpeed: 0 only when every defect the job has is fixed here by default."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if not hasattr(DeepSpeedZeroOptimizer,
                   "_use_compact_grad_partition_buffer") and "DS_OFFLOAD_PATCH_SKIPPED_STEP" in env:
        code = 0  # before 0.19.8: no freeze to fix
    result = run_command(CLI + ["affected", "--json", UPSTREAM], env=env)
    assert result.returncode == code, result
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["exit"] == code and report["job"]["grad_accum_dtype"] == "fp32", report


def test_an_unreadable_config_exits_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = run_command(CLI + ["affected", str(bad)])
    assert result.returncode == 2 and "cannot read" in result.stdout, result


def test_an_offloaded_zero_1_2_job_in_fp32_meets_the_invalid_norm_where_the_release_has_it():
    """fp32 steps are never checked: on 0.14.0 - 0.19.7 one inf crashes step() or makes the master weights NaN, fixed
    where the invalid-norm fix is applied; bf16 depends on the release (a maybe); fp16 checks every step; 0.19.8 skips
    such a step itself (``not-needed``)."""
    old = dict(version="0.17.6", skipped_step="not-needed", invalid_norm="applied")
    fp32 = _config(UPSTREAM, bf16__enabled=False)
    assert _verdicts(fp32, _status(**old))["invalid-norm"] == ("yes", "yes")
    assert _verdicts(fp32, _status(**dict(old, invalid_norm="off")))["invalid-norm"] == ("yes", "no")
    assert _verdicts(fp32, _status())["invalid-norm"][0] == "no"  # 0.19.8: not-needed
    assert _verdicts(_config(UPSTREAM), _status(**old))["invalid-norm"] == ("maybe", "yes")
    check_off = read_job(_config(UPSTREAM, bf16__check_grad_overflow=False))
    assert "leaves that opt-out" in by_name("invalid-norm").affects(check_off)[1]
    fp16 = _config(UPSTREAM, bf16__enabled=False, fp16__enabled=True)
    assert _verdicts(fp16, _status(**old))["invalid-norm"][0] == "no"


@pytest.mark.parametrize("path", [UPSTREAM, HF_GENERATED, ACCELERATE], ids=["upstream", "hf-trainer", "accelerate"])
def test_a_bf16_config_that_leaves_the_check_out_meets_deepspeed_s_default(path):
    """The configs HF Trainer and Accelerate write leave ``check_grad_overflow`` out: on 0.17.1 - 0.19.2 DeepSpeed's
    default is off, fixed where the bf16-check default is applied; a config that sets the key (either way), fp16 and
    fp32 are not this defect's; from 0.19.3 DeepSpeed checks by default (``not-needed``)."""
    assert read_job(_config(path)).check_grad_overflow is None
    old = dict(version="0.17.6", skipped_step="not-needed", bf16_check="applied")
    assert _verdicts(_config(path), _status(**old))["bf16-unchecked"] == ("yes", "yes")
    assert _verdicts(_config(path), _status(**dict(old, bf16_check="off")))["bf16-unchecked"] == ("yes", "no")
    assert _verdicts(_config(path), _status())["bf16-unchecked"][0] == "no"  # 0.19.8: not-needed
    for value in (True, False):
        assert _verdicts(_config(path, bf16__check_grad_overflow=value), _status(**old))["bf16-unchecked"][0] == "no"
    fp32 = _config(path, bf16__enabled=False)
    assert _verdicts(fp32, _status(**old))["bf16-unchecked"][0] == "no"
    assert "check_grad_overflow unset" in read_job(_config(path)).text()


def test_a_job_s_shape_is_the_recorded_cell_it_runs_as():
    assert one_inf.cell_key(2, False, "bf16", None, 4) == "s2-bf16-unset-ga2"
    assert one_inf.cell_key(3, True, "bf16", False, 1) == "s3-param-bf16-off-ga1"
    assert one_inf.cell_key(1, True, "fp32", None, 1) == "s1-fp32-ga1"  # offload_param is ZeRO-3's
    assert one_inf.cell_key(2, False, "auto", None, 1) is None and one_inf.cell_key(0, False, "fp16", None, 1) is None
    assert one_inf.cell_key("auto", False, "fp16", None, 1) is None


def test_a_release_reads_the_outcome_recorded_on_the_release_that_stands_for_it():
    found = one_inf.outcome("0.17.3", "s2-fp32-ga1")
    assert (found.recorded_on, found.unpatched, found.patched) == ("0.17.6", "nan-weights", "skipped"), found
    assert one_inf.outcome("0.16.1+local", "s2-fp32-ga1").recorded_on == "0.14.4"
    assert "step() crashes" in one_inf.outcome("0.16.5", "s1-fp32-ga2").text()
    assert one_inf.outcome("0.20.0", "s2-fp32-ga1") is None and one_inf.outcome("0.19.8", None) is None


def test_the_command_names_the_job_s_outcome_on_the_installed_release():
    result = run_command(CLI + ["affected", "--json", UPSTREAM])
    report = json.loads(result.stdout[result.stdout.index("{"):])
    import deepspeed
    job = read_job(_config(UPSTREAM))
    key = one_inf.cell_key(job.stage, job.offload_param, job.precision, job.check_grad_overflow, job.grad_accum)
    assert key is not None, job
    expected = one_inf.outcome(deepspeed.__version__, key)
    assert report["one_inf"] == (dataclasses.asdict(expected) if expected else None), report
    text = run_command(CLI + ["affected", UPSTREAM]).stdout
    assert (expected.text() if expected else "one inf/NaN: not recorded") in text, text
    off = run_command(CLI + ["affected", UPSTREAM], env={"DS_OFFLOAD_PATCH_DISABLE": "1"}).stdout
    assert expected is None or "the whole package (disabled) off" in off, off


def test_a_change_left_out_where_the_loaded_release_does_not_need_it_leaves_nothing_unfixed():
    """A change switched off (or the package disabled) on the DeepSpeed loaded here counts as not fixed only where its
    guard would apply it there; a status of another DeepSpeed is not judged by the loaded one."""
    import deepspeed
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401  (the class the guard looks at)

    from deepspeed_offload_patch.testing.installed import has_defect
    ga1 = _config(UPSTREAM, zero_optimization__stage=2, gradient_accumulation_steps=1)
    here = _verdicts(ga1, _status(version=deepspeed.__version__, several_backwards="off"))["dropped-backwards"]
    assert here == (("maybe", "no") if has_defect("several-backwards") else ("no", "-")), here
    other = "0.17.6" if deepspeed.__version__.strip() != "0.17.6" else "0.18.9"
    assert _verdicts(ga1, _status(version=other, several_backwards="off"))["dropped-backwards"] == ("maybe", "no")


def _waits(config, status) -> dict:
    from deepspeed_offload_patch.affected import host_waits
    job = read_job(config)
    return {
        wait.kind: (wait.affected, wait.removed_by, wait.removed)
        for wait in host_waits(job, status, findings(job, status))
    }


def test_each_host_wait_per_tensor_is_named_with_what_removes_it(tmp_path):
    """The waits a job makes on a GPU by stage, accumulation, pin_memory and release: the event waits of 0.19.8's
    accumulating ZeRO-2 (the opt-in event-wait fix), the copies into pageable memory (pin_memory: true, which 0.19.5
    made the default), ZeRO-3's blocking copies up to 0.19.4 (0.19.5); the reads, which the sync fix removes."""
    zero2 = {**_config(UPSTREAM), "gradient_accumulation_steps": 2}
    zero2["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    waits = _waits(zero2, _status())
    assert waits["read"][0] == "yes" and waits["read"][2], waits
    assert waits["event wait"][0] == "yes" and not waits["event wait"][2], waits
    assert "opt-in" in waits["event wait"][1] and "DS_OFFLOAD_PATCH_EVENT_WAITS=1" in waits["event wait"][1]
    assert "blocking copy" not in waits  # pin_memory unset: pinned by default on 0.19.8
    assert _waits(zero2, _status(event_waits="applied"))["event wait"][2]
    # The same job on 0.19.4: pageable by default, and no event waits (the release has none).
    old = _waits(zero2, _status(version="0.19.4", event_waits="not-needed", skipped_step="not-needed"))
    assert set(old) == {"read", "blocking copy"} and old["blocking copy"][1] == "offload_optimizer.pin_memory: true"
    zero2["zero_optimization"]["offload_optimizer"]["pin_memory"] = False
    assert _waits(zero2, _status())["blocking copy"][0] == "yes"  # asked for pageable buffers on any release
    zero3 = {**zero2, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    assert set(_waits(zero3, _status(version="0.19.4"))) == {"blocking copy"}
    assert "0.19.5" in _waits(zero3, _status(version="0.19.4"))["blocking copy"][1]
    assert _waits(zero3, _status()) == {}


def test_the_defect_of_an_opt_in_change_does_not_set_the_exit_code(tmp_path):
    config = {**_config(UPSTREAM), "gradient_accumulation_steps": 2}
    config["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    found = findings(read_job(config), _status())
    waits = next(f for f in found if f.defect == "per-tensor-waits")
    assert (waits.affected, waits.fixed) == ("yes", "no") and not waits.stays
    assert not any(f.stays for f in found)
