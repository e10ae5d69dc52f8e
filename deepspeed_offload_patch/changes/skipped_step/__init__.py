# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The skipped-step fix: its record, and how the guard decides on it.

DeepSpeed 0.19.8 accumulates fp32 gradients in a compact partition buffer; with ``offload_optimizer``, a step skipped
for an inf/NaN leaves the buffer, and its inf/NaN, in place, so every later step skips too. The replacement of
``reset_cpu_buffers`` (:mod:`.methods`) drops the buffer after a skipped step. On by default where DeepSpeed has the
defect; not part of DeepSpeed pull request 8963.

Its decision weighs more than the methods it replaces: whether the class has a compact buffer at all (else the fix is
not needed), and ``step()``, which it does not replace but whose overflow branch is what leaves the buffer behind.
"""

from deepspeed_offload_patch import guard
from deepspeed_offload_patch.changes.record import Change, Form
from deepspeed_offload_patch.changes.skipped_step.probe import probe_skipped_step
from deepspeed_offload_patch.fingerprints import UNFIXED
from deepspeed_offload_patch.states import State


def _methods():
    from deepspeed_offload_patch.changes.skipped_step import methods
    return methods


def decide(change: Change, cls: type, version: str) -> guard.Decision:
    """Decide on the skipped-step fix for ``cls``: ``not-needed`` without a compact gradient buffer (DeepSpeed before
    0.19.8); ``applied`` (with the replacement) when ``reset_cpu_buffers`` and ``step`` are the known forms;
    ``conflict`` when someone else replaced ``reset_cpu_buffers``; otherwise :func:`probe_skipped_step` decides
    between ``upstream-fixed`` and ``unsupported`` (whose reason names the interpreter where it, not DeepSpeed, is
    what changed)."""
    form = change.forms[-1]
    name, (witness, ) = form.tracker, form.witnesses
    refused = guard.version_refused(version)
    if refused is not None:
        return guard.Decision(State.UNSUPPORTED, refused)
    if not hasattr(cls, "_use_compact_grad_partition_buffer"):
        return guard.Decision(
            State.NOT_NEEDED, f"DeepSpeed {version} has no compact fp32 gradient partition buffer (added in "
            f"{change.first_release}): a "
            "skipped step leaves no gradient behind")
    found, replacement = guard.classify_method(cls, name, change)
    step = cls.__dict__.get(witness)
    step_known = step is not None and guard.fingerprint(step) in UNFIXED.get(change.key(witness), {})
    methods = {
        name: found,
        witness: guard.PATCHABLE if step_known else (guard.MISMATCH if step is not None else guard.MISSING)
    }
    decision = guard.settled(found, cls, name, version, methods)
    if decision is not None:
        return decision
    if found == guard.PATCHABLE and step_known:
        releases = guard.releases_shipping({change.key(witness): step})
        shape = (
            f"step() and {name} match the form of DeepSpeed {guard.releases_text(releases)}, whose skipped steps keep "
            "their gradient")
        if guard.newer_than_tested(version):
            reason = f"DeepSpeed {version} is newer than the releases tested ({guard.FIRST} to {guard.LAST}); its {shape}"
        else:
            reason = f"DeepSpeed {version}: {shape}"
        return guard.Decision(State.APPLIED, reason, methods, {name: replacement})
    problem = probe_skipped_step(cls)
    if problem is None:
        return guard.Decision(
            State.UPSTREAM_FIXED, f"DeepSpeed {version}: a skipped step leaves no gradient behind (its "
            "step() behaves as fixed)", methods)
    odd = ", ".join(f"{method}: {result}" for method, result in methods.items() if result != guard.PATCHABLE)
    python = guard.interpreter_problem(change) if guard.MISMATCH in methods.values() else None
    if python:
        return guard.Decision(State.UNSUPPORTED, f"{python} ({odd}); DeepSpeed {version} is left unchanged", methods)
    return guard.Decision(
        State.UNSUPPORTED, f"DeepSpeed {version}: {cls.__name__}.step {problem}, in a form this fix was not built for "
        f"({odd})", methods)


def affects(job) -> tuple:
    """Whether an offloaded ZeRO-1/2 ``job`` (:class:`deepspeed_offload_patch.affected.Job`) can freeze: fp32 gradient
    accumulation apart from the model's dtype, in a precision that skips a step for an inf/NaN."""
    if not (job.grad_accum_dtype == "fp32" and job.precision != "fp32"):
        return "no", "gradients accumulate in the precision's dtype"
    skips = {
        "fp16": "yes",
        # Unset: on where this fix applies (DeepSpeed 0.19.8's default; before 0.19.3 the package turns it on).
        "bf16":
        "yes" if job.check_grad_overflow in (True, None) else "maybe" if job.check_grad_overflow == "auto" else "no",
        "auto": "maybe"
    }.get(job.precision, "no")
    if skips == "no":
        return "no", "this precision does not skip steps for an inf/NaN"
    return skips, f"fp32 gradient accumulation under {job.precision}"


CHANGE = Change(
    name="skipped-step",
    title="the skipped-step fix",
    label="skipped-step fix",
    forms=(Form(("reset_cpu_buffers", ),
                tracker="reset_cpu_buffers",
                first_release="0.19.8",
                functions=(("reset_cpu_buffers", "reset_cpu_buffers"), ),
                witnesses=("step", )), ),
    methods=_methods,
    decide=decide,
    # In effect, not needed (no compact buffer), or switched off by the user's choice.
    good_states=(State.APPLIED, State.UPSTREAM_FIXED, State.NOT_NEEDED, State.OFF),
    about="after a step skipped for an inf/NaN, the compact fp32 gradient buffer is dropped instead of carrying the "
    "inf/NaN into every later step (the defect came with 0.19.8's buffer).",
    state_key="skipped_step",
    reason_key="skipped_step_reason",
    diff_help="the skipped-step fix's diff instead (DeepSpeed 0.19.8: a skipped step's gradient is not carried into "
    "the next steps)",
    defect=("skipped-step", "one inf/NaN makes every later step skip"),
    affects=affects,
    verify_checks=("step-after-a-skip", ),
)
