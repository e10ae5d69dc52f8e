# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The states of a change (each record of :mod:`deepspeed_offload_patch.changes`), as ``status()`` reports them.

The one vocabulary of the package, its CLI, the pytest plugin and CI: nothing else spells a state. A :class:`State`
is a ``str`` whose value is the word printed and written to JSON (``status --json``), so comparing one with the plain
word, formatting it, ``str()``, ``repr()`` and ``json.dumps`` all give what they gave when states were plain strings.
"""

import enum


class State(str, enum.Enum):
    """Where one change stands in this process; the value is the word that ``status()`` and the CLI print."""

    #: Installed: the methods are this package's replacements.
    APPLIED = "applied"
    #: DeepSpeed's ZeRO module is not imported yet; the patch applies when it is.
    PENDING = "pending"
    #: The installed DeepSpeed has the fixed form already (in its own words or ours).
    UPSTREAM_FIXED = "upstream-fixed"
    #: Left unchanged: a release or code this package was not built for (or its module failed to import).
    UNSUPPORTED = "unsupported"
    #: Another patch replaced one of the methods; never clobbered.
    CONFLICT = "conflict"
    #: ``DS_OFFLOAD_PATCH_DISABLE`` is set.
    DISABLED = "disabled"
    #: No importable ``deepspeed`` package.
    DEEPSPEED_MISSING = "deepspeed-missing"
    #: ``revert()`` put DeepSpeed's originals back (or cancelled the pending patch).
    REVERTED = "reverted"
    #: Nothing applied in this process (before the package's import, or under ``DS_OFFLOAD_PATCH_AUTO=0``).
    NOT_APPLIED = "not-applied"
    #: The installed DeepSpeed does not have the defect this change fixes.
    NOT_NEEDED = "not-needed"
    #: A default-on change left out by its switch (or ``DS_OFFLOAD_PATCH_UPSTREAM_ONLY``).
    OFF = "off"

    # The value, not ``State.APPLIED``, wherever a state is printed: output stays as it was with plain strings.
    __str__ = str.__str__
    __format__ = str.__format__

    def __repr__(self) -> str:
        # As the plain string's: PatchStatus's repr and printed dicts of states read as they always did.
        return repr(self.value)


#: States in which DeepSpeed's offload overflow check does not synchronize the host per gradient.
GOOD_STATES = (State.APPLIED, State.UPSTREAM_FIXED)
