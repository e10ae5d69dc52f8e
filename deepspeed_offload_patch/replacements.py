# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""What one change installs on a DeepSpeed class: the record of its originals and replacements, the replacement as
DeepSpeed decorates its own method, and the watch for subclasses that override a replaced method."""

import gc
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional

from deepspeed_offload_patch.guard import unwrapped
from deepspeed_offload_patch.log import warn_once


@dataclass
class AppliedPatch:
    """What one change installed on DeepSpeed's class in this process: the class, DeepSpeed's functions and their
    replacements (by method name), and the ``__init_subclass__`` hook it added to the class (None when the class had
    one already: DeepSpeed's own, or an earlier change's)."""

    change: str  # the change's name
    cls: type
    originals: Dict[str, Callable]
    replacements: Dict[str, Callable]
    subclass_watch: Optional[object] = None

    def ours(self, name: str) -> bool:
        """Whether the class's attribute ``name`` is still this change's replacement."""
        return name in self.replacements and self.cls.__dict__.get(name) is self.replacements[name]


def as_decorated(original: Callable, replacement: Callable) -> Callable:
    """``replacement`` under DeepSpeed's NVTX range decorator where DeepSpeed's own method has it (ZeRO-3's), so that
    a profile still shows the method's range."""
    if unwrapped(original) is original:
        return replacement
    from deepspeed.utils.nvtx import instrument_w_nvtx
    return instrument_w_nvtx(replacement)


def subclasses(cls: type) -> List[type]:
    found, pending = [], list(cls.__subclasses__())
    while pending:
        sub = pending.pop()
        if sub not in found:
            found.append(sub)
            pending.extend(sub.__subclasses__())
    return found


def warn_if_overriding(sub: type, records: Iterable[AppliedPatch]) -> None:
    """A subclass that defines a patched method itself runs its own method, not the patch's: say which (``records``:
    the changes applied)."""
    for record in list(records):
        for name in record.replacements:
            if name in sub.__dict__ and record.cls in sub.__mro__:
                warn_once(f"{sub.__module__}.{sub.__qualname__} overrides {record.cls.__name__}.{name}: its instances "
                          f"run that override instead of the patch's {name} (the other patched methods still apply)")


def watch_subclasses(cls: type, records: Callable[[], Iterable[AppliedPatch]]) -> Optional[object]:
    """Warn about overriding subclasses defined after the patch, too: hook their creation with
    ``__init_subclass__`` on the patched class (removed on revert), checking them against ``records()`` (the changes
    applied then). Returns the hook; None, and nothing added, when the class has one already (DeepSpeed's own, or the
    hook of a set applied before)."""
    if "__init_subclass__" in cls.__dict__:
        return None

    def __init_subclass__(sub, **kwargs):
        super(cls, sub).__init_subclass__(**kwargs)
        warn_if_overriding(sub, records())

    cls.__init_subclass__ = classmethod(__init_subclass__)
    return cls.__dict__["__init_subclass__"]


def settle_live_flags(cls: type) -> None:
    """Turn a device flag that the patched tracker left in a live optimizer of ``cls`` into the Python bool that
    DeepSpeed's own methods keep there (one host read per optimizer, once). Optimizers are found through the garbage
    collector, which tracks every instance: revert is rare, and the patch keeps no references to them."""
    import torch

    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which some lazy module objects warn about.
        if issubclass(type(obj), cls) and torch.is_tensor(vars(obj).get("local_overflow")):
            obj.local_overflow = bool(obj.local_overflow)
