# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The pytest plugin's former module name: ``pytest_ds_offload_patch`` is the plugin (this module is kept for
environments installed before it moved; importing it imports the package, which patches)."""

from pytest_ds_offload_patch import host_sync_counter, no_host_sync, pytest_addoption, pytest_configure  # noqa: F401
