# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""A skipped step is never silent: one WARNING per optimizer step that DeepSpeed skips for an inf/NaN, and a louder
line when steps are skipped in a row (DeepSpeed issue 8415: ZeRO skips the step without a word in bf16, and a job whose
every step skips looks like a job that trains).

It wraps ``DeepSpeedEngine._take_model_step``, where the engine counts a skipped step: the engine's own Python count
(``skipped_steps``) is compared before and after, so no host read is added and DeepSpeed's behaviour is unchanged.
Installed when ``deepspeed.runtime.engine`` is imported (at once if it is), by the patcher; the wrapper is removed by
``revert()``. ``DS_OFFLOAD_PATCH_SKIP_LOG=0`` (or ``DS_OFFLOAD_PATCH_UPSTREAM_ONLY=1``) leaves it out.
"""

import sys
from types import ModuleType
from typing import Callable, Dict, Optional

#: The module and class it wraps, and the method.
MODULE, CLASS, METHOD = "deepspeed.runtime.engine", "DeepSpeedEngine", "_take_model_step"
#: From this many skipped steps in a row the line is an ERROR that says so (a lone skip is a WARNING).
IN_A_ROW = 3

_counts = {"skipped": 0, "in_a_row": 0}
_installed: Dict[type, Callable] = {}


def skipped_steps() -> int:
    """How many optimizer steps the DeepSpeed engines of this process skipped since the package was imported (counted
    while the log is installed), on every rank; 0 when it is not."""
    return _counts["skipped"]


def installed() -> bool:
    """Whether the engine's step is wrapped now."""
    return any(_installed_wrapper(cls) is not None for cls in _installed)


def _installed_wrapper(cls: type) -> Optional[Callable]:
    wrapper = cls.__dict__.get(METHOD)
    return wrapper if getattr(wrapper, "__ds_offload_patch_skip_log__", False) else None


def _say(engine) -> None:
    """The line for one skipped step of ``engine`` (whose counts include it), on rank 0."""
    from deepspeed_offload_patch.log import rank_and_world

    if rank_and_world()[0] != 0:
        return
    logger = sys.modules["deepspeed.utils.logging"].logger
    step, total, row = engine.global_steps, _counts["skipped"], _counts["in_a_row"]
    scale = getattr(getattr(engine, "optimizer", None), "loss_scale", None)
    why = "inf/NaN in the gradients" + (f", loss scale now {scale:g}"
                                        if isinstance(scale, float) and engine.fp16_enabled() else "")
    if row >= IN_A_ROW:
        logger.error(
            "[deepspeed_offload_patch] step %d skipped (%s): %d steps skipped in a row, %d so far: the job is not "
            "learning; an inf/NaN that stays in a gradient, a data problem or (fp16) a loss scale at its floor "
            "looks like this", step, why, row, total)
    else:
        logger.warning("[deepspeed_offload_patch] step %d skipped (%s); %d skipped so far", step, why, total)


def _wrap(original: Callable) -> Callable:

    def _take_model_step(self, *args, **kwargs):
        before = self.skipped_steps
        result = original(self, *args, **kwargs)
        if self.skipped_steps != before:
            _counts["skipped"] += 1
            _counts["in_a_row"] += 1
            _say(self)
        else:
            _counts["in_a_row"] = 0
        return result

    _take_model_step.__wrapped__ = original
    _take_model_step.__ds_offload_patch_skip_log__ = True
    return _take_model_step


def install(module: ModuleType) -> None:
    """Wrap ``module.DeepSpeedEngine._take_model_step`` (``module`` is DeepSpeed's engine module). A second call
    changes nothing; a class without the method is left alone."""
    cls = getattr(module, CLASS, None)
    if cls is None or METHOD not in cls.__dict__ or _installed_wrapper(cls) is not None:
        return
    original = cls.__dict__[METHOD]
    _installed[cls] = original
    setattr(cls, METHOD, _wrap(original))


def uninstall() -> None:
    """Put the engine's own method back, where the attribute is still the wrapper (someone who replaced it since keeps
    theirs)."""
    for cls, original in list(_installed.items()):
        if _installed_wrapper(cls) is not None:
            setattr(cls, METHOD, original)
        del _installed[cls]
