# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The rank-agreement fix: its record, and how the guard decides on it.

With ``offload_optimizer``, ZeRO-1 on DeepSpeed 0.17.1 - 0.17.6 (fp16, or bf16 with the check on) checks each rank's
gradients for an overflow without agreeing on the result: an inf on one rank makes it skip the step while the others
take it, and the next collective fails or hangs. The replacement of ``_check_overflow`` (:mod:`.methods`) has
``has_overflow`` all-reduce the flag over the data parallel ranks whenever the optimizer is offloaded, as DeepSpeed
0.18.0 does. On by default where DeepSpeed has the defect; not part of DeepSpeed pull request 8963.

``_check_overflow`` is the same text on every release, and the defect lies in ``step()`` and ``has_overflow`` together
(the upstream change replaces the latter, in the same words), so :func:`.probe.probe_agreement` reads those two to
decide, whichever of them is installed; the fingerprint says whether ``_check_overflow`` is DeepSpeed's known text.
"""

from deepspeed_offload_patch import guard
from deepspeed_offload_patch.changes.rank_agreement.probe import METHOD, probe_agreement
from deepspeed_offload_patch.changes.record import Change, Form
from deepspeed_offload_patch.states import State


def _methods():
    from deepspeed_offload_patch.changes.rank_agreement import methods
    return methods


def decide(change: Change, cls: type, version: str) -> guard.Decision:
    """``applied`` where ``_check_overflow`` is DeepSpeed's known text and :func:`probe_agreement` finds that the
    ranks can disagree (0.17.1 - 0.17.6); ``not-needed`` where it finds that they agree; ``conflict`` when someone
    else replaced ``_check_overflow``; ``unsupported`` for a release it refuses, or unknown code whose ranks can
    disagree (the reason says why)."""
    refused = guard.version_refused(version)
    if refused is not None:
        return guard.Decision(State.UNSUPPORTED, refused)
    found, replacement = guard.classify_method(cls, METHOD, change)
    methods = {METHOD: found}
    decision = guard.settled(found, cls, METHOD, version, methods)
    if decision is not None:
        return decision
    problem = probe_agreement(cls)
    if problem is None:
        return guard.Decision(State.NOT_NEEDED, f"DeepSpeed {version}: the ranks agree about an overflow at every "
                              "stage", methods)
    if found == guard.PATCHABLE:
        prefix = (f"DeepSpeed {version} is newer than the releases tested ({guard.FIRST} to {guard.LAST}); its"
                  if guard.newer_than_tested(version) else f"DeepSpeed {version}:")
        return guard.Decision(State.APPLIED, f"{prefix} has_overflow {problem}", methods, {METHOD: replacement})
    return guard.Decision(
        State.UNSUPPORTED, f"DeepSpeed {version}: {cls.__name__}.has_overflow {problem}, and {METHOD} is in a form "
        f"this fix was not built for ({found})", methods)


def affects(job) -> tuple:
    """Whether an offloaded ``job`` (:class:`deepspeed_offload_patch.affected.Job`) can split its ranks on an
    overflow: ZeRO-1 in a precision whose steps are checked (fp16, bf16 with the check on)."""
    if job.stage not in (1, "auto"):
        return "no", "ZeRO-2 all-reduces the overflow flag"
    if job.precision == "fp32" or (job.precision == "bf16" and job.check_grad_overflow is False):
        return "no", "no overflow check runs in this precision"
    return "maybe" if "auto" in (job.stage, job.precision) else "yes", (
        "one inf/NaN on one rank: that rank skips the step, the others take it, and the next collective fails or "
        "hangs")


CHANGE = Change(
    name="rank-agreement",
    title="the rank-agreement fix",
    label="rank-agreement fix",
    forms=(Form((METHOD, ),
                tracker=METHOD,
                first_release="0.17.1",
                until="0.18.0",
                functions=((METHOD, "_check_overflow"), )), ),
    methods=_methods,
    decide=decide,
    # In effect, not needed (the ranks agree), or switched off by the user's choice.
    good_states=(State.APPLIED, State.UPSTREAM_FIXED, State.NOT_NEEDED, State.OFF),
    about="with offload_optimizer, ZeRO-1's ranks agree about an overflow (the flag is all-reduced over the data "
    "parallel ranks, as at ZeRO-2), instead of one skipping the step while the others take it and the next collective "
    "failing (DeepSpeed 0.17.1 - 0.17.6; fixed upstream in 0.18.0).",
    state_key="rank_agreement",
    reason_key="rank_agreement_reason",
    diff_help="the rank-agreement fix's diff instead (DeepSpeed 0.17.1 - 0.17.6: ZeRO-1's ranks agree about an "
    "overflow)",
    defect=("ranks-disagree", "one inf/NaN on one rank splits ZeRO-1's ranks: one skips, the others step"),
    affects=affects,
)
