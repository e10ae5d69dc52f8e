# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""pytest plugin (entry point ``pytest11``; a top-level module, so that loading it does not import the package,
whose import patches): the host-sync fixtures for any test, and the patch only when asked.

    def test_my_step(engine, loss, no_host_sync):
        with no_host_sync():          # HostSyncError at the first host wait, naming the op and the line
            engine.backward(loss)

    def test_sync_budget(engine, loss, host_sync_counter):
        with host_sync_counter() as syncs:
            engine.step()
        assert syncs.total <= 5, syncs.counts

A plugin that changes the code under test is opt-in: installing the package changes no other project's test runs.
``pytest --ds-offload-patch``, or ``ds_offload_patch = true`` in the ini file, applies the patch in the pytest process
(as ``import deepspeed_offload_patch`` does: now, or when DeepSpeed's ZeRO module is imported). Without either, the
plugin leaves DeepSpeed as it is; its fixtures import the package's helpers with ``DS_OFFLOAD_PATCH_AUTO=0``, so
``status()`` then says ``not-applied`` (a test may still call ``deepspeed_offload_patch.apply()``). A test module that
imports ``deepspeed_offload_patch`` itself, before any fixture did, patches as that import always does.
torch is imported only when a fixture is used.
"""

import importlib
import importlib.util
import os
import runpy
import sys

import pytest

OPTION = "--ds-offload-patch"
INI = "ds_offload_patch"
_asked = False


def pytest_addoption(parser) -> None:
    group = parser.getgroup("ds-offload-patch")
    group.addoption(OPTION,
                    action="store_true",
                    default=False,
                    help="apply deepspeed_offload_patch (the ZeRO offload overflow flag fix) in the pytest process")
    parser.addini(INI, type="bool", default=False, help="apply deepspeed_offload_patch in the pytest process")


def pytest_configure(config) -> None:
    global _asked
    _asked = bool(config.getoption("ds_offload_patch") or config.getini(INI))
    if _asked:
        import deepspeed_offload_patch as dop
        from deepspeed_offload_patch.states import State
        if dop.status().state == State.NOT_APPLIED:  # imported earlier without patching
            dop.patch_on_import()


def _auto_switch() -> str:
    """The name of the switch that stops the package's import from patching (``settings.AUTO``), read from the
    package's ``settings.py`` without importing the package (that import is what must not patch yet)."""
    package = importlib.util.find_spec("deepspeed_offload_patch")  # a top-level name: finds, imports nothing
    return runpy.run_path(os.path.join(os.path.dirname(package.origin), "settings.py"))["AUTO"]


def _testing():
    """``deepspeed_offload_patch.testing``; when the run did not ask for the patch and nothing imported the package
    yet, imported without patching."""
    if "deepspeed_offload_patch" not in sys.modules and not _asked:
        auto = _auto_switch()
        from_env = os.environ.get(auto)
        os.environ[auto] = "0"
        try:
            importlib.import_module("deepspeed_offload_patch")
        finally:
            if from_env is None:
                del os.environ[auto]
            else:
                os.environ[auto] = from_env
    return importlib.import_module("deepspeed_offload_patch.testing")


@pytest.fixture
def no_host_sync():
    """:func:`deepspeed_offload_patch.testing.no_host_sync`, the context manager that fails on any host read."""
    return _testing().no_host_sync


@pytest.fixture
def host_sync_counter():
    """:func:`deepspeed_offload_patch.testing.count_host_syncs`, the context manager that counts host reads by op."""
    return _testing().count_host_syncs
