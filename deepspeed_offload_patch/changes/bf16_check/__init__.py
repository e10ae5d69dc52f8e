# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The bf16-check default: its record, and how the guard decides on it.

DeepSpeed 0.17.1 - 0.19.2 default bf16's ``check_grad_overflow`` to false, and the configs that HF Trainer and
Accelerate write leave the key out: an offloaded ZeRO-1/2 bf16 job then applies a step whose gradient holds an inf or
a NaN, and its master weights turn NaN. DeepSpeed 0.19.3 turned the default on (pull request 8035). The check was off
because it read the host once per tensor; with the package's overflow fix it reads it once per step, so the package
gives those releases 0.19.3's default. A config that sets the key keeps its value: ``false`` is the user's opt-out.
Not part of DeepSpeed pull request 8963.

The change sets the default of ``DeepSpeedBF16Config.check_grad_overflow`` (:mod:`.default`), which is all that
0.19.3 changed; it replaces no method, so it has no fingerprint, and the guard reads the default itself.
"""

from packaging.specifiers import SpecifierSet

from deepspeed_offload_patch import guard
from deepspeed_offload_patch.changes.bf16_check import default
from deepspeed_offload_patch.changes.record import Change, Default, Target
from deepspeed_offload_patch.states import State

#: The bf16 section of DeepSpeed's config.
#: The bf16 section of DeepSpeed's config (its module is new in 0.16.x's successors: older releases lack it).
BF16_CONFIG = Target("deepspeed.runtime.precision_config", "DeepSpeedBF16Config", (1, 2), optional=True)
FIELD = "check_grad_overflow"
DEFAULT = Default(FIELD, value=True, unfixed=False, first_release="0.17.1", until="0.19.3")


def _methods():
    return default


def decide(change: Change, cls: type, version: str) -> guard.Decision:
    """``applied`` where the field defaults to false (0.17.1 - 0.19.2), with the class attributes that carry the new
    default; ``not-needed`` where it defaults to true on a release that shipped true (0.19.3 and later) or where
    there is no such field (before 0.17.1: no check to turn on; the fix of the invalid gradient norm skips those
    steps);
    ``upstream-fixed`` where a release that shipped false defaults to true (``patches/`` applied); ``conflict`` where
    the default is neither; ``unsupported`` for a release the package refuses, a class that is not a pydantic 2
    model, or one whose rebuild fails (the reason says what pydantic raised)."""
    refused = guard.version_refused(version)
    if refused is not None:
        return guard.Decision(State.UNSUPPORTED, refused)
    if default.is_ours(cls, FIELD):
        return guard.Decision(State.APPLIED, f"DeepSpeed {version}: already applied")
    if not isinstance(getattr(cls, "__pydantic_fields__", None), dict):
        return guard.Decision(State.UNSUPPORTED, f"DeepSpeed {version}: {cls.__name__} is not a pydantic 2 model")
    field = default.field_of(cls, FIELD)
    if field is None:
        return guard.Decision(
            State.NOT_NEEDED, f"DeepSpeed {version}: bf16 has no {FIELD} to turn on (a bf16 step with an inf/NaN is "
            "skipped by the fix of its invalid gradient norm)")
    release = guard.release_of(version)
    shipped_off = SpecifierSet(DEFAULT.releases).contains(release)
    where = f"{cls.__name__}.{FIELD}"
    if field.default is DEFAULT.value:
        if shipped_off:
            return guard.Decision(State.UPSTREAM_FIXED, f"DeepSpeed {version}: {where} already defaults to true")
        return guard.Decision(State.NOT_NEEDED, f"DeepSpeed {version}: {where} defaults to true")
    if field.default is not DEFAULT.unfixed:
        return guard.Decision(
            State.CONFLICT,
            f"DeepSpeed {version}: {where} defaults to {field.default!r}, neither DeepSpeed's false nor "
            "this change's true: someone else set it")
    try:
        attributes = default.with_default(cls, FIELD, DEFAULT.value)
    except Exception as exc:  # a pydantic this was not built for: leave DeepSpeed as it is
        return guard.Decision(
            State.UNSUPPORTED, f"DeepSpeed {version}: {where} could not be given a new default ({type(exc).__name__}: "
            f"{exc})")
    prefix = (f"DeepSpeed {version} is newer than the releases tested ({guard.FIRST} to {guard.LAST});"
              if guard.newer_than_tested(version) else f"DeepSpeed {version}:")
    return guard.Decision(
        State.APPLIED, f"{prefix} {where} defaults to false; a config that leaves it out now "
        "checks every bf16 step, as from DeepSpeed 0.19.3", {}, attributes)


def affects(job) -> tuple:
    """Whether an offloaded ZeRO-1/2 ``job`` (:class:`deepspeed_offload_patch.affected.Job`) leaves bf16's check to
    DeepSpeed's default, which is off on 0.17.1 - 0.19.2."""
    if job.precision not in ("bf16", "auto"):
        return "no", "not bf16"
    if job.check_grad_overflow is not None:
        return "no", f"the config sets check_grad_overflow to {str(job.check_grad_overflow).lower()}"
    return "maybe" if job.precision == "auto" else "yes", (
        "bf16 leaves check_grad_overflow to DeepSpeed's default, off on 0.17.1 - 0.19.2: one inf/NaN then turns the "
        "master weights into NaN")


CHANGE = Change(
    name="bf16-check",
    title="the bf16-check default",
    label="bf16-check default",
    forms=(),
    methods=_methods,
    decide=decide,
    # In effect, not needed (DeepSpeed checks by default, or has no check), or switched off by the user's choice.
    good_states=(State.APPLIED, State.UPSTREAM_FIXED, State.NOT_NEEDED, State.OFF),
    about="a bf16 config that leaves out check_grad_overflow checks every step for an inf/NaN, as DeepSpeed 0.19.3 "
    "does by default, instead of applying it and turning the master weights into NaN (DeepSpeed 0.17.1 - 0.19.2 "
    "default it to false); an explicit false is left alone.",
    state_key="bf16_check",
    reason_key="bf16_check_reason",
    diff_help="the bf16-check default's diff instead (DeepSpeed 0.17.1 - 0.19.2: bf16's check_grad_overflow defaults "
    "to true)",
    defect=("bf16-unchecked", "bf16's check_grad_overflow defaults to false: one inf/NaN turns the weights into NaN"),
    affects=affects,
    verify_checks=("check-left-out", ),
    target=BF16_CONFIG,
    default=DEFAULT,
)
