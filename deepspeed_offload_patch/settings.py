# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The environment switches, read when they are needed (never cached, so tests and launchers can set them)."""

import os

#: ``1``: importing the package does nothing, and ``apply()`` does not patch (state ``disabled``).
DISABLE = "DS_OFFLOAD_PATCH_DISABLE"
#: ``1``: raise :class:`~deepspeed_offload_patch.PatchError` instead of warning when the patch cannot apply.
STRICT = "DS_OFFLOAD_PATCH_STRICT"
#: ``0``: importing the package does not patch (state ``not-applied``); ``apply()`` still does. On by default.
AUTO = "DS_OFFLOAD_PATCH_AUTO"
#: ``1`` (CI's, not the package's): the release tests fail, instead of skipping, on a supported Python this machine
#: lacks (``tests/release/test_pythons.py``; ``.ci/run`` sets it).
ALL_PYTHONS = "DS_OFFLOAD_PATCH_ALL_PYTHONS"
#: ``1``: exactly the change of DeepSpeed pull request 8963 (the overflow flag on the device) and nothing else: every
#: other change stays off whatever its own switch says. Each of those has its own switch, ``0`` to leave it out: its
#: name in capitals after :data:`NAME_PREFIX` (:attr:`deepspeed_offload_patch.changes.record.Change.switch`).
UPSTREAM_ONLY = "DS_OFFLOAD_PATCH_UPSTREAM_ONLY"
#: What every switch's name starts with (messages that speak of them all: ``DS_OFFLOAD_PATCH_*``).
NAME_PREFIX = "DS_OFFLOAD_PATCH_"
#: 0: no line for a skipped step (``skip_log``); also left out under ``UPSTREAM_ONLY``.
SKIP_LOG = "DS_OFFLOAD_PATCH_SKIP_LOG"

# Set by ``ds-offload-patch audit`` for the ranks it launches (deepspeed_offload_patch.audit.rank reads them).
#: The folder the rank reports go to; the audit is on in a process only when this is set.
AUDIT_DIR = "DS_OFFLOAD_PATCH_AUDIT_DIR"
#: How many optimizer steps to count (default 3).
AUDIT_STEPS = "DS_OFFLOAD_PATCH_AUDIT_STEPS"
#: ``1``: end the process (exit 0) once the counted steps are reported.
AUDIT_STOP_AFTER = "DS_OFFLOAD_PATCH_AUDIT_STOP_AFTER"
#: How many source lines per phase each rank keeps (default 10).
AUDIT_TOP = "DS_OFFLOAD_PATCH_AUDIT_TOP"
#: ``0``: rank 0 does not print the table (``audit --compare`` prints both runs side by side instead).
AUDIT_PRINT = "DS_OFFLOAD_PATCH_AUDIT_PRINT"
#: CI only (``ci/sdists.py``): the folder of the cached DeepSpeed sdists.
SDISTS = "DS_OFFLOAD_PATCH_SDISTS"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag(name: str,
         odd: bool = False,
         unset: bool = False,
         odd_means: str = "which leaves DeepSpeed untouched") -> bool:
    """Read a boolean switch: ``1/true/yes/on`` or ``0/false/no/off`` (any case); unset or empty means ``unset``.

    Any other value counts as ``odd``, with a warning that names the switch, the value and the reading (logged
    once), and what that reading does (``odd_means``). Each switch passes the reading that changes DeepSpeed least.
    """
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return unset
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    from deepspeed_offload_patch.log import warn_once
    warn_once(f"{name}={os.environ[name]!r} is neither 0 nor 1; treating it as {int(odd)}, {odd_means}")
    return odd


def disabled() -> bool:
    return flag(DISABLE, odd=True)


def strict() -> bool:
    """An odd value reads as 0: a patch that cannot apply warns (training goes on) rather than raising."""
    return flag(STRICT, odd_means="not strict: a patch that cannot apply warns instead of raising")


def upstream_only() -> bool:
    """An odd value reads as 1: the fewer changes."""
    return flag(UPSTREAM_ONLY, odd=True, odd_means="which applies only the upstream change")


def change_on(change) -> bool:
    """Whether to apply ``change`` (a :class:`~deepspeed_offload_patch.changes.record.Change`): the upstream change
    always (``DS_OFFLOAD_PATCH_DISABLE`` aside); any other unless its switch is false or ``UPSTREAM_ONLY`` is true, and
    an opt-in one (``change.opt_in``) only when its switch is true. An odd value of either reads as the one that
    leaves the change out, with a warning."""
    if change.switch is None:
        return True
    return not upstream_only() and flag(
        change.switch, odd=False, unset=not change.opt_in, odd_means=f"so {change.title} is left out")


def off_as_by_default(change) -> bool:
    """Whether ``change`` is an opt-in one that nothing switches on (neither its switch nor ``UPSTREAM_ONLY`` set):
    off because the package's defaults leave it off."""
    return bool(change.opt_in) and not upstream_only() and not flag(change.switch)


def skip_log_on() -> bool:
    """Whether to say each skipped step (:mod:`deepspeed_offload_patch.skip_log`): unless ``SKIP_LOG`` is false or
    ``UPSTREAM_ONLY`` is true; an odd value reads as off, with a warning."""
    return not upstream_only() and flag(SKIP_LOG, odd=False, unset=True, odd_means="so skipped steps are not logged")


def auto() -> bool:
    """Whether importing the package patches: on when ``DS_OFFLOAD_PATCH_AUTO`` is unset or true; any other value
    than true or false warns and reads as 0 (the import patches nothing)."""
    return flag(AUTO, odd=False, unset=True, odd_means="so importing the package patches nothing (apply() still does)")
