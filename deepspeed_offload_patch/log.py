# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Logging: DeepSpeed's logger when DeepSpeed is loaded, each message once per process, on rank 0 only."""

import logging
import os
import sys
from typing import Tuple

_seen = set()


def _logger() -> logging.Logger:
    # Never import DeepSpeed just to log: use its logger only once it is loaded.
    ds_logging = sys.modules.get("deepspeed.utils.logging")
    if ds_logging is not None and hasattr(ds_logging, "logger"):
        return ds_logging.logger
    return logging.getLogger("deepspeed_offload_patch")


def rank_and_world() -> Tuple[int, int]:
    """This process's rank and the world size: from ``deepspeed.comm`` once it is initialized (never importing it),
    else ``$RANK`` and ``$WORLD_SIZE`` (0 and 1 when unset or not numbers)."""
    comm = sys.modules.get("deepspeed.comm")
    try:
        if comm is not None and comm.is_initialized():
            return comm.get_rank(), comm.get_world_size()
    except Exception:  # a half-initialized or torn-down backend must not break logging or a report
        pass
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def _rank() -> int:
    return rank_and_world()[0]


def log_once(level: int, message: str) -> None:
    """Log ``message`` at ``level`` the first time it is seen in this process, on rank 0 (``$RANK`` before init)."""
    if message in _seen:
        return
    _seen.add(message)
    if _rank() == 0:
        _logger().log(level, "[deepspeed_offload_patch] %s", message, stacklevel=3)


def warn_once(message: str) -> None:
    log_once(logging.WARNING, message)


def info_once(message: str) -> None:
    log_once(logging.INFO, message)
