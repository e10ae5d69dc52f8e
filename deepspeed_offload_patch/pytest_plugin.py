# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""pytest plugin (entry point ``pytest11``): fixtures that give the host-sync guard to any test.

    def test_my_step(engine, loss, no_host_sync):
        with no_host_sync():          # HostSyncError at the first host read, naming the op and the line
            engine.backward(loss)

    def test_sync_budget(engine, loss, host_sync_counter):
        with host_sync_counter() as syncs:
            engine.step()
        assert syncs.total <= 5, syncs.counts

Loading the plugin imports ``deepspeed_offload_patch``, which applies the patch in the pytest process as any import
does (``DS_OFFLOAD_PATCH_DISABLE=1`` to compare with unpatched DeepSpeed). torch is imported only when a fixture is
used.
"""

import pytest


@pytest.fixture
def no_host_sync():
    """:func:`deepspeed_offload_patch.testing.no_host_sync`, the context manager that fails on any host read."""
    from deepspeed_offload_patch.testing import no_host_sync as guard
    return guard


@pytest.fixture
def host_sync_counter():
    """:func:`deepspeed_offload_patch.testing.count_host_syncs`, the context manager that counts host reads by op."""
    from deepspeed_offload_patch.testing import count_host_syncs
    return count_host_syncs
