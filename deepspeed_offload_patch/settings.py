# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The environment switches, read when they are needed (never cached, so tests and launchers can set them)."""

import os

#: ``1``: importing the package does nothing, and ``apply()`` does not patch (state ``disabled``).
DISABLE = "DS_OFFLOAD_PATCH_DISABLE"
#: ``1``: raise :class:`~deepspeed_offload_patch.PatchError` instead of warning when the patch cannot apply.
STRICT = "DS_OFFLOAD_PATCH_STRICT"
#: ``1``: also apply the opt-in on-device gradient norm for ``step()`` (off by default).
GRAD_NORM = "DS_OFFLOAD_PATCH_GRAD_NORM"
#: ``0``: importing the package does not patch (state ``not-applied``); ``apply()`` still does. On by default.
AUTO = "DS_OFFLOAD_PATCH_AUTO"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag(name: str, odd: bool = False, unset: bool = False) -> bool:
    """Read a boolean switch: ``1/true/yes/on`` or ``0/false/no/off`` (any case); unset or empty means ``unset``.

    Any other value counts as ``odd``, with a warning that names the switch, the value and the reading (logged
    once). Each switch passes the reading that leaves DeepSpeed untouched.
    """
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return unset
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    from deepspeed_offload_patch.log import warn_once
    warn_once(f"{name}={os.environ[name]!r} is neither 0 nor 1; treating it as {int(odd)}, which leaves DeepSpeed "
              f"untouched")
    return odd


def disabled() -> bool:
    return flag(DISABLE, odd=True)


def strict() -> bool:
    return flag(STRICT)


def grad_norm() -> bool:
    return flag(GRAD_NORM)


def auto() -> bool:
    """Whether importing the package patches: on when ``DS_OFFLOAD_PATCH_AUTO`` is unset or true; any other value
    than true or false warns and reads as 0 (the import patches nothing)."""
    return flag(AUTO, odd=False, unset=True)
