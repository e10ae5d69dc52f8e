# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Runs ``DistributedTest`` methods on spawned ranks; makes ``unit.common`` importable (as DeepSpeed's tests do)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from unit.common import DistributedTest, run_distributed_test  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "fails_unpatched: the test exists for the patch and must fail on unpatched DeepSpeed "
        "(checked by ci/check_red_green.py)")
    config.addinivalue_line(
        "markers", "equivalence: the test sets the patch switch of the processes it trains in itself (patched and "
        "unpatched, and compares them, or one of the two); the DS_OFFLOAD_PATCH_* switches of the pytest process do not "
        "change it")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.cls is not None and issubclass(pyfuncitem.cls, DistributedTest):
        kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
        run_distributed_test(pyfuncitem.cls, pyfuncitem.function.__name__, kwargs)
        return True
    return None
