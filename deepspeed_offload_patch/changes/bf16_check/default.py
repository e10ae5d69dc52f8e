# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""A new default for a field of a DeepSpeed config model (pydantic 2), as class attributes the patcher can install and
put back.

A pydantic model keeps its fields and its compiled validator in class attributes. :func:`with_default` builds the
model once with the new default, takes the attributes that rebuild changed, and restores DeepSpeed's own: the class
is as it was when it returns, and installing those attributes (``setattr``) gives the new default, putting DeepSpeed's
back (``setattr`` again) gives its own, the same objects.
"""

import copy
from typing import Any, Dict

#: The field objects this package made, by ``id``: the guard's test for "already applied".
_OURS: Dict[int, Any] = {}


def field_of(cls: type, field: str) -> Any:
    """The pydantic ``FieldInfo`` of ``field`` on ``cls``, or None when ``cls`` is not a pydantic 2 model with it."""
    fields = getattr(cls, "__pydantic_fields__", None)
    return fields.get(field) if isinstance(fields, dict) else None


def is_ours(cls: type, field: str) -> bool:
    """Whether ``cls``'s field ``field`` is the one :func:`with_default` made."""
    found = field_of(cls, field)
    return found is not None and _OURS.get(id(found)) is found


def with_default(cls: type, field: str, value: Any) -> Dict[str, Any]:
    """The class attributes of ``cls`` that give ``field`` the default ``value`` (a rebuilt validator with them), by
    name. ``cls`` is left as it was, also when this raises.

    Raises:
        RuntimeError: the rebuilt model does not default ``field`` to ``value``, or keeps an explicit value from
            reaching it (the pydantic in use builds models in a way this was not written for).
        Exception: whatever pydantic raises while rebuilding.
    """
    before = dict(cls.__dict__)
    fields = dict(cls.__pydantic_fields__)
    changed = copy.copy(fields[field])
    changed.default = value
    try:
        cls.__pydantic_fields__ = {**fields, field: changed}
        cls.model_rebuild(force=True)
        if getattr(cls(), field) != value or getattr(cls(**{field: not value}), field) == value:
            raise RuntimeError(f"{cls.__name__} rebuilt with {field}={value!r} does not default to it")
        after = dict(cls.__dict__)
        added = sorted(set(after) - set(before))
        if added:
            raise RuntimeError(f"rebuilding {cls.__name__} adds attributes ({', '.join(added)}) that revert could not "
                               "take back exactly")
    finally:
        for name in list(cls.__dict__):
            if name not in before:
                delattr(cls, name)
        for name, original in before.items():
            if cls.__dict__.get(name) is not original:
                setattr(cls, name, original)
    _OURS[id(changed)] = changed
    return {name: attribute for name, attribute in after.items() if before.get(name) is not attribute}
