# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The registry of the changes this package makes to DeepSpeed: one record each (:mod:`.record`), in one module each.

Order is the order ``status`` and ``check`` report them in; the first is the upstream change (DeepSpeed pull request
8963), whose state is ``status()``'s ``state``. Adding a change is a module under this folder and one line here
(``docs/design.md``).
"""

from typing import Tuple

from deepspeed_offload_patch.changes import (bf16_check, event_waits, grad_accumulation, grad_norm, invalid_norm,
                                             overflow_flag, rank_agreement, several_backwards, skipped_step,
                                             zero3_overflow)
from deepspeed_offload_patch.changes.record import Change, Target

CHANGES: Tuple[Change, ...] = (
    overflow_flag.CHANGE,
    skipped_step.CHANGE,
    grad_norm.CHANGE,
    grad_accumulation.CHANGE,
    several_backwards.CHANGE,
    invalid_norm.CHANGE,
    bf16_check.CHANGE,
    rank_agreement.CHANGE,
    zero3_overflow.CHANGE,
    event_waits.CHANGE,
)
#: The upstream change: the package's ``state``, ``reason`` and ``diff``'s default.
UPSTREAM = CHANGES[0]
#: The changes reported beside it, each with its own state, reason and switch.
OTHERS = CHANGES[1:]


def by_name(name: str) -> Change:
    """The change called ``name``. Raises LookupError for a name no change has."""
    for change in CHANGES:
        if change.name == name:
            return change
    raise LookupError(f"no change is called {name!r} (changes: {', '.join(c.name for c in CHANGES)})")


def all_methods() -> Tuple[str, ...]:
    """Every method some change replaces or reads, by its key (:meth:`Target.key`): the fingerprint table covers them
    all."""
    return tuple(dict.fromkeys(change.key(name) for change in CHANGES for name in change.method_names))


def targets() -> Tuple[Target, ...]:
    """The classes the changes replace methods (or set a default) of, ZeRO-1/2's first."""
    return tuple(dict.fromkeys(change.target for change in CHANGES))
