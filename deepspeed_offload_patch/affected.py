# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""``ds-offload-patch affected CONFIG``: which defects a DeepSpeed job has, read from its config, and whether this
package fixes each with the DeepSpeed installed here.

The config is the JSON a job passes to the ``deepspeed`` launcher (``--deepspeed``), to HF Trainer
(``TrainingArguments(deepspeed=...)``) or to Accelerate (``deepspeed_config_file``). HF's ``"auto"`` values are filled
by the Trainer at run time: where one decides a defect, the answer is ``maybe``. The defects:

* ``host-sync``: one host synchronization per gradient tensor in every boundary backward (ZeRO-1/2 with
  ``offload_optimizer``; DeepSpeed 0.14.0 - 0.19.8). Fixed by the overflow flag fix (DeepSpeed pull request 8963).
* ``skipped-step``: one inf/NaN makes every later step skip (ZeRO-1/2 with ``offload_optimizer``, fp32 gradient
  accumulation under bf16 with its overflow check on, or fp16; DeepSpeed 0.19.8, whose compact buffer keeps it).
  Fixed by the skipped-step fix.
* ``step-reads``: ``step()`` reads one host value per owned gradient tensor (its norm; ZeRO-1/2 with offload).
  Fixed by the on-device gradient norm (on by default; DeepSpeed 0.14.0 and later).

Exit code: 0 when the job has no defect that stays (none, or each fixed here by default), 1 when it has one (or
may have one, with ``"auto"``), 2 when the config cannot be read.
"""

import json
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Union

YES, NO, MAYBE = "yes", "no", "maybe"
AUTO = "auto"


@dataclass
class Job:
    """What of a DeepSpeed config the defects depend on; ``"auto"`` where HF fills the value at run time."""

    stage: Union[int, str]
    offload: Optional[str]  # offload_optimizer's device, None without it
    precision: str  # bf16, fp16, fp32 or auto
    check_grad_overflow: Union[bool, str]  # bf16's switch (True by default); fp16 always checks, fp32 never
    grad_accum_dtype: Optional[str]

    def text(self) -> str:
        check = ""
        if self.precision in ("bf16", AUTO):
            check = f" (check_grad_overflow {_word(self.check_grad_overflow, 'on', 'off')})"
        return (f"ZeRO-{self.stage}, offload_optimizer {self.offload or 'none'}, {self.precision}{check}, "
                f"grad_accum_dtype {self.grad_accum_dtype or 'as the precision'}")


@dataclass
class Finding:
    """One defect: whether the job has it (yes, no, maybe), why, and what the package does about it here."""

    defect: str
    affected: str
    why: str
    fixed: str  # "yes", "no" or "-" (nothing to fix)
    change: str  # the change and its state here

    @property
    def stays(self) -> bool:
        """The job has (or may have) the defect, and no default change fixes it here."""
        return self.affected != NO and self.fixed == NO


def _word(value: Any, true: str, false: str) -> str:
    return AUTO if value == AUTO else (true if value else false)


def _enabled(section: Any) -> Union[bool, str]:
    if not isinstance(section, dict):
        return False
    value = section.get("enabled", False)
    return AUTO if value == AUTO else bool(value)


def read_job(config: Dict[str, Any]) -> Job:
    """The :class:`Job` of a DeepSpeed config (a dict, as the JSON file holds it). Raises ValueError on a config
    that is no DeepSpeed config (not an object)."""
    if not isinstance(config, dict):
        raise ValueError("a DeepSpeed config is a JSON object")
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    offload = (zero.get("offload_optimizer") or {}) if isinstance(zero, dict) else {}
    device = offload.get("device") if isinstance(offload, dict) else None
    bf16 = config.get("bf16", config.get("bfloat16"))
    fp16 = config.get("fp16")
    bf16_on, fp16_on = _enabled(bf16), _enabled(fp16)
    if bf16_on is True:
        precision = "bf16"
    elif fp16_on is True:
        precision = "fp16"
    elif AUTO in (bf16_on, fp16_on):
        precision = AUTO
    else:
        precision = "fp32"
    check = bf16.get("check_grad_overflow", True) if isinstance(bf16, dict) else True
    data_types = config.get("data_types") or {}
    accum = data_types.get("grad_accum_dtype") if isinstance(data_types, dict) else None
    return Job(stage=stage,
               offload=device if device not in (None, "none") else None,
               precision=precision,
               check_grad_overflow=AUTO if check == AUTO else bool(check),
               grad_accum_dtype=accum)


def _offloaded(job: Job) -> str:
    if job.offload is None:
        return NO
    if job.stage == AUTO:
        return MAYBE
    return YES if job.stage in (1, 2) else NO


def findings(job: Job, status) -> List[Finding]:
    """The three defects for ``job`` on the DeepSpeed that ``status`` (the package's :class:`PatchStatus`) describes."""
    from deepspeed_offload_patch.states import GOOD_STATES, State

    version = status.deepspeed_version or "(not installed)"
    offloaded = _offloaded(job)
    where = "ZeRO-1/2 with offload_optimizer" if offloaded != NO else "not ZeRO-1/2 with offload_optimizer"
    found = []

    # The per-gradient host syncs: every ZeRO-1/2 offload job on a DeepSpeed with the defect.
    if offloaded == NO:
        found.append(Finding("host-sync", NO, where, "-", f"the overflow flag fix: {status.state}"))
    elif status.state == State.UPSTREAM_FIXED:
        found.append(
            Finding("host-sync", NO, f"DeepSpeed {version} has the fix", "-", "the overflow flag fix: "
                    f"{status.state}"))
    else:
        fixed = YES if status.state in GOOD_STATES else NO
        found.append(Finding("host-sync", offloaded, where, fixed, f"the overflow flag fix: {status.state}"))

    # The freeze: fp32 accumulation apart from the model's dtype, where a bad gradient skips the step.
    change = f"the skipped-step fix: {status.skipped_step}"
    separate = job.grad_accum_dtype == "fp32" and job.precision != "fp32"
    skips = {
        "fp16": YES,
        "bf16": YES if job.check_grad_overflow is True else MAYBE if job.check_grad_overflow == AUTO else NO,
        AUTO: MAYBE
    }.get(job.precision, NO)
    if offloaded == NO or not separate or skips == NO:
        why = where if offloaded == NO else ("gradients accumulate in the precision's dtype"
                                             if not separate else "this precision does not skip steps for an inf/NaN")
        found.append(Finding("skipped-step", NO, why, "-", change))
    elif status.skipped_step in (State.NOT_NEEDED, State.UPSTREAM_FIXED):
        found.append(Finding("skipped-step", NO, f"DeepSpeed {version}: {status.skipped_step}", "-", change))
    else:
        affected = MAYBE if MAYBE in (offloaded, skips) else YES
        fixed = YES if status.skipped_step == State.APPLIED else NO
        found.append(
            Finding("skipped-step", affected, f"{where}, fp32 gradient accumulation under {job.precision}", fixed,
                    change))

    # step()'s reads of each gradient norm: the on-device grad norm removes them.
    norm = f"the on-device grad norm: {status.grad_norm_on_device}"
    if offloaded == NO:
        found.append(Finding("step-reads", NO, where, "-", norm))
    else:
        fixed = YES if status.grad_norm_on_device in GOOD_STATES else NO
        found.append(Finding("step-reads", offloaded, where, fixed, norm))
    return found


TITLES = {
    "host-sync": "a host sync per gradient in each boundary backward",
    "skipped-step": "one inf/NaN makes every later step skip",
    "step-reads": "step() reads one host value per gradient tensor",
}


def report(path: str, resolve_status: Callable[[], Any], as_json: bool = False) -> int:
    """Print what the job of the config at ``path`` has, on the DeepSpeed whose status ``resolve_status()`` gives
    (called only once the config is read); returns the exit code (0, 1, or 2 when the config cannot be read)."""
    import platform

    try:
        with open(path) as f:
            job = read_job(json.load(f))
    except (OSError, ValueError) as exc:
        print(f"ds-offload-patch affected: cannot read {path}: {exc}")
        return 2
    status = resolve_status()
    found = findings(job, status)
    code = 1 if any(finding.stays for finding in found) else 0
    if as_json:
        print(
            json.dumps(
                {
                    "config": path,
                    "deepspeed_version": status.deepspeed_version,
                    "python": platform.python_version(),
                    "job": asdict(job),
                    "defects": [asdict(finding) for finding in found],
                    "exit": code
                },
                indent=2))
        return code
    print(f"ds-offload-patch affected: {path}, DeepSpeed {status.deepspeed_version or '(not installed)'} "
          f"(Python {platform.python_version()})")
    print(f"job: {job.text()}")
    for finding in found:
        if finding.affected == NO:
            verdict = f"not affected ({finding.why})"
        else:
            fix = {YES: "fixed", NO: "NOT fixed"}
            verdict = f"{'affected' if finding.affected == YES else 'maybe affected'} ({finding.why}); " \
                      f"{fix[finding.fixed]}"
        print(f"{TITLES[finding.defect]}: {verdict} [{finding.change}]")
    return code
