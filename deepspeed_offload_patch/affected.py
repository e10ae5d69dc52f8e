# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""``ds-offload-patch affected CONFIG``: which defects a DeepSpeed job has, read from its config, and whether this
package fixes each with the DeepSpeed installed here.

The config is the JSON a job passes to the ``deepspeed`` launcher (``--deepspeed``), to HF Trainer
(``TrainingArguments(deepspeed=...)``) or to Accelerate (``deepspeed_config_file``). HF's ``"auto"`` values are filled
by the Trainer at run time: where one decides a defect, the answer is ``maybe``. The defects are those the changes of
:mod:`deepspeed_offload_patch.changes` fix, one each (its record's ``defect``): only a ZeRO-1/2 job with
``offload_optimizer`` has them, and a change's ``affects`` narrows that where the defect needs more (a precision, an
accumulation dtype).

Then the host waits per tensor the job makes on a GPU, each with its kind and what removes it: the defects above
that are such waits (a change's record says which), and those that a setting or a DeepSpeed release removes instead
(:mod:`.waits`: ``pin_memory``, ZeRO-3's copies up to 0.19.4).

A last line names what one inf/NaN gradient does to the job, unpatched and with the package's defaults, as
``nox -s outcomes`` recorded it on the release that stands for the installed one (:mod:`.one_inf`).

Exit code: 0 when the job has no defect that stays (none, or each fixed here by default), 1 when it has one (or
may have one, with ``"auto"``), 2 when the config cannot be read. The defect of an opt-in change (off until it is
proven, ``status`` says why) and the waits that a setting removes are reported but do not count.
"""

import json
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from deepspeed_offload_patch import one_inf, waits
from deepspeed_offload_patch.changes import CHANGES, OTHERS
from deepspeed_offload_patch.guard import release_of
from deepspeed_offload_patch.states import State
# A verdict's words, shared with the waits a setting removes.
from deepspeed_offload_patch.waits import MAYBE, NO, YES

#: Each change by the name of the defect it fixes.
_BY_DEFECT = {change.defect[0]: change for change in CHANGES}
AUTO = "auto"


@dataclass
class Job:
    """What of a DeepSpeed config the defects depend on; ``"auto"`` where HF fills the value at run time."""

    stage: Union[int, str]
    offload: Optional[str]  # offload_optimizer's device, None without it
    precision: str  # bf16, fp16, fp32 or auto
    # bf16's switch; None where the config leaves it to DeepSpeed's default (off on 0.17.1 - 0.19.2, on from 0.19.3);
    # fp16 always checks, fp32 never.
    check_grad_overflow: Union[bool, str, None]
    grad_accum_dtype: Optional[str]
    grad_accum: Union[int, str] = 1  # gradient_accumulation_steps (1 by default)
    offload_param: bool = False  # ZeRO-3's offload_param to a device
    pin_memory: Optional[bool] = None  # offload_optimizer's; None where the config leaves it to the release's default

    def text(self) -> str:
        check = ""
        if self.precision in ("bf16", AUTO):
            value = self.check_grad_overflow
            check = f" (check_grad_overflow {'unset' if value is None else _word(value, 'on', 'off')})"
        pin = f" (pin_memory {'unset' if self.pin_memory is None else _word(self.pin_memory, 'true', 'false')})"
        return (f"ZeRO-{self.stage}, offload_optimizer {self.offload or 'none'}{pin if self.offload else ''}, "
                f"{self.precision}{check}, grad_accum_dtype {self.grad_accum_dtype or 'as the precision'}, "
                f"gradient_accumulation_steps {self.grad_accum}")


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
        """The job has (or may have) the defect, and no default change fixes it here (an opt-in change's defect does
        not count: the package does not fix it by default yet)."""
        return self.affected != NO and self.fixed == NO and not _BY_DEFECT[self.defect].opt_in


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
    pin = offload.get("pin_memory") if isinstance(offload, dict) else None
    param = (zero.get("offload_param") or {}) if isinstance(zero, dict) else {}
    param_device = param.get("device") if isinstance(param, dict) else None
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
    check = bf16.get("check_grad_overflow") if isinstance(bf16, dict) else None
    data_types = config.get("data_types") or {}
    accum = data_types.get("grad_accum_dtype") if isinstance(data_types, dict) else None
    steps = config.get("gradient_accumulation_steps", 1)
    return Job(stage=stage,
               offload=device if device not in (None, "none") else None,
               precision=precision,
               check_grad_overflow=check if check in (AUTO, None) else bool(check),
               grad_accum_dtype=accum,
               grad_accum=steps if steps == AUTO or isinstance(steps, int) else 1,
               offload_param=param_device not in (None, "none"),
               pin_memory=None if pin in (None, AUTO) else bool(pin))


def _offloaded(job: Job, stages: Tuple[int, ...]) -> str:
    """Whether ``job`` offloads the optimizer at one of ``stages``."""
    if job.offload is None:
        return NO
    if job.stage == AUTO:
        return MAYBE
    return YES if job.stage in stages else NO


def findings(job: Job, status) -> List[Finding]:
    """Each change's defect for ``job`` on the DeepSpeed that ``status`` (the package's :class:`PatchStatus`)
    describes, in the order of :data:`deepspeed_offload_patch.changes.CHANGES`.

    Only a job that offloads the optimizer at a stage whose class the change replaces methods of (ZeRO-1/2, or
    ZeRO-3) can have its defect; a change's ``affects(job)`` narrows that further (the precision, the accumulation
    dtype). A DeepSpeed that does not need the change (``not-needed``, ``upstream-fixed``; or, for a change switched
    off or disabled, whose guard would not apply it to the DeepSpeed loaded here) has no such defect; otherwise the
    change fixes it where it is ``applied``.
    """
    version = status.deepspeed_version or "(not installed)"
    found = []
    for change in CHANGES:
        offloaded = _offloaded(job, change.target.stages)
        stages = change.target.stage_text
        where = f"{stages} with offload_optimizer" if offloaded != NO else f"not {stages} with offload_optimizer"
        state = status.of(change)[0]
        defect, what = change.defect[0], f"{change.title}: {state}"
        affected, why = change.affects(job) if change.affects is not None else (YES, "")
        if offloaded == NO or affected == NO:
            found.append(Finding(defect, NO, where if offloaded == NO else why, "-", what))
        elif state in (State.NOT_NEEDED, State.UPSTREAM_FIXED):
            found.append(Finding(defect, NO, f"DeepSpeed {version}: {state}", "-", what))
        elif state in (State.OFF, State.DISABLED) and _needless_here(change, status.deepspeed_version):
            found.append(Finding(defect, NO, f"DeepSpeed {version}: {state}, and not needed there", "-", what))
        else:
            found.append(
                Finding(defect, MAYBE if MAYBE in (offloaded, affected) else YES, f"{where}, {why}" if why else where,
                        YES if state == State.APPLIED else NO, what))
    return found


@dataclass
class Wait:
    """One host wait per tensor that the job makes on a GPU: its kind, what it is, whether the job has it (yes,
    maybe), and what removes it here (``removed``: a change applied here removes it)."""

    kind: str
    what: str
    affected: str
    why: str
    removed_by: str
    removed: bool


def host_waits(job: Job, status, found: List[Finding]) -> List[Wait]:
    """The host waits per tensor the job has (or may have) on a GPU with the DeepSpeed ``status`` describes: the
    ``found`` defects that are such waits (the change that removes each, and whether it is applied), then those of
    :data:`deepspeed_offload_patch.waits.WAITS` (the setting or release that removes each)."""
    listed = []
    for finding in found:
        change = _BY_DEFECT[finding.defect]
        if change.wait and finding.affected != NO:
            opt_in = f": opt-in, {change.switch}=1 turns it on" if change.opt_in and finding.fixed != YES else ""
            how = f"{change.title} ({status.of(change)[0]}{opt_in})"
            listed.append(Wait(change.wait, change.defect[1], finding.affected, finding.why, how,
                               finding.fixed == YES))
    release = release_of(status.deepspeed_version) if status.deepspeed_version else None
    for wait in waits.WAITS:
        affected, why = wait.applies(job, release)
        if affected != NO:
            listed.append(Wait(wait.kind, wait.what, affected, why, wait.removed_by, False))
    return listed


def _needless_here(change, version: Optional[str]) -> bool:
    """For a change left out (its switch, or the package disabled): whether the DeepSpeed loaded in this process, the
    one ``version`` names, has no defect for it (its guard would not apply it), so that leaving it out leaves nothing
    unfixed. False where that class is not loaded, or is of another version (a status of some other DeepSpeed)."""
    import sys

    module = sys.modules.get(change.target.module)
    cls = getattr(module, change.target.name, None)
    loaded = getattr(sys.modules.get("deepspeed"), "__version__", None)
    if cls is None or version is None or loaded != version:
        return False
    return change.decide(change, cls, version).state in (State.NOT_NEEDED, State.UPSTREAM_FIXED)


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
    shape = one_inf.cell_key(job.stage, job.offload_param, job.precision, job.check_grad_overflow, job.grad_accum)
    recorded = one_inf.outcome(status.deepspeed_version, shape) if job.offload else None
    stalls = host_waits(job, status, found)
    if as_json:
        print(
            json.dumps(
                {
                    "config": path,
                    "deepspeed_version": status.deepspeed_version,
                    "python": platform.python_version(),
                    "job": asdict(job),
                    "defects": [asdict(finding) for finding in found],
                    "host_waits": [asdict(wait) for wait in stalls],
                    "one_inf": asdict(recorded) if recorded else None,
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
        print(f"{_BY_DEFECT[finding.defect].defect[1]}: {verdict} [{finding.change}]")
    print(f"host waits per tensor on a GPU: {'none known' if not stalls else len(stalls)}")
    for wait in stalls:
        has = "" if wait.affected == YES else "maybe: "
        fate = f"removed by {wait.removed_by}" if wait.removed else f"stays: removed by {wait.removed_by}"
        print(f"  {wait.kind}: {has}{wait.what} ({wait.why}); {fate}")
    print(_one_inf_line(job, status, recorded))
    return code


def _one_inf_line(job: Job, status, recorded: Optional[one_inf.Outcome]) -> str:
    """What one inf/NaN does to the job, as recorded (:mod:`deepspeed_offload_patch.one_inf`), or why that is not
    known; with the switches that make this process differ from the package's defaults."""
    if job.offload is None:
        return "one inf/NaN: no offload_optimizer, outside what was recorded"
    if recorded is None:
        return (f"one inf/NaN: not recorded for this job on DeepSpeed {status.deepspeed_version or '(not installed)'}"
                " (a setting left to \"auto\", a stage outside 1 - 3, or a release past those recorded)")
    # An opt-in change that is off is as the defaults have it.
    off = [change.title for change in OTHERS if status.of(change)[0] == State.OFF and not change.opt_in]
    if status.state == State.DISABLED:
        off = ["the whole package (disabled)"]
    note = f"; here {', '.join(off)} off, so the unpatched outcome may apply" if off else ""
    return recorded.text() + note
