# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""A small ``DistributedTest`` in the shape of DeepSpeed's: each test method runs on ``world_size`` spawned ranks.

A subclass sets ``world_size`` (and ``timeout``, in seconds); ``tests/conftest.py`` runs every test method of it
through :func:`run_distributed_test`. Ranks rendezvous through a ``file://`` store, see LOCAL_SIZE, fail together,
and a rank that hangs is named.
"""

from typing import Any, Dict

from deepspeed_offload_patch.testing.launch import run_distributed


class DistributedTest:
    world_size = 2
    timeout = 300


def _call_method(cls: type, name: str, kwargs: Dict[str, Any]) -> None:
    getattr(cls(), name)(**kwargs)


def run_distributed_test(cls: type, name: str, kwargs: Dict[str, Any]) -> None:
    run_distributed(_call_method, cls.world_size, args=(cls, name, kwargs), timeout=cls.timeout)
