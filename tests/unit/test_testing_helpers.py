# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The host-sync guard and RaisingBoolTensor: what they catch, what they let through, and inside autograd hooks; the
hang guards of the harness name what hung and the time it had."""

import os

import pytest
import torch

from deepspeed_offload_patch import settings
from deepspeed_offload_patch.testing import HostSyncError, RaisingBoolTensor, count_host_syncs, no_host_sync


@pytest.mark.parametrize("read, op", [
    (lambda t: t.sum().item(), "aten._local_scalar_dense"),
    (lambda t: bool(t.any()), "aten._local_scalar_dense"),
    (lambda t: float(t[0]), "aten._local_scalar_dense"),
    (lambda t: t.tolist(), "Tensor.tolist"),
    (lambda t: t.numpy(), "Tensor.numpy"),
    (lambda t: torch.equal(t, t), "aten.equal"),
])
def test_each_host_read_is_counted_and_refused(read, op):
    t = torch.tensor([1.0, 2.0])
    with count_host_syncs() as syncs:
        read(t)
    assert syncs.counts == {op: 1}, syncs.counts
    with pytest.raises(HostSyncError, match=op):
        with no_host_sync():
            read(t)


def test_device_side_work_is_not_a_sync():
    flag = torch.zeros((), dtype=torch.bool)
    with no_host_sync(), count_host_syncs() as syncs:
        for grad in (torch.ones(3), torch.tensor([1.0, float("nan")])):
            flag = flag | torch.isnan(grad).any()
        torch.nonzero(torch.ones(3))  # data-dependent, but free on the CPU
    assert syncs.total == 0 and flag.item()


def test_syncs_inside_autograd_hooks_are_seen():
    x = torch.ones(3, requires_grad=True)
    x.register_hook(lambda grad: grad * (1.0 if grad.sum().item() > 0 else 0.0))
    with count_host_syncs() as syncs:
        (x * 2).sum().backward()
    assert syncs.counts["aten._local_scalar_dense"] == 1
    assert "test_testing_helpers.py" in syncs.events[0][1], syncs.events


def test_error_names_the_python_line():
    with pytest.raises(HostSyncError) as info:
        with no_host_sync():
            if torch.tensor(1.0) > 0:  # the line to name
                pass
    assert "test_testing_helpers.py" in str(info.value) and "the line to name" in str(info.value)


def test_raising_bool_tensor():
    flag = RaisingBoolTensor.wrap(torch.tensor(True))
    for truth_test in (bool, lambda t: 1 if t else 0, lambda t: t and True, lambda t: not t):
        with pytest.raises(HostSyncError):
            truth_test(flag)
    derived = flag | torch.tensor(False)
    assert isinstance(derived, RaisingBoolTensor) and isinstance(flag.to(torch.uint8), RaisingBoolTensor)
    assert flag.item() is True and type(RaisingBoolTensor.plain(flag)) is torch.Tensor


def _sleep_forever() -> None:
    import time
    time.sleep(3600)


def test_a_hung_rank_is_named_with_the_time_it_had():
    from deepspeed_offload_patch.testing.launch import DistributedFailure, run_distributed
    with pytest.raises(DistributedFailure, match=r"rank\(s\) \[0, 1\] of _sleep_forever did not finish within 3 s"):
        run_distributed(_sleep_forever, world_size=2, timeout=3)


def test_a_hung_command_is_named_with_the_time_it_had():
    from unit.common import run_python
    with pytest.raises(AssertionError, match=r"hang guard: .* did not finish within 2 s; it printed:\nstarted"):
        run_python("import time; print('started', flush=True); time.sleep(3600)", timeout=2)


class _ReportsAnotherDevice(torch.Tensor):
    """A CPU tensor that says it lives on ``device`` (as an accelerator's tensors do), for testing without one."""

    @staticmethod
    def __new__(cls, inner, device):
        wrapper = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=device)
        wrapper.inner = inner
        return wrapper

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        def unwrap(x):
            return x.inner if isinstance(x, _ReportsAnotherDevice) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_on_an_accelerator_only_reads_of_its_tensors_count():
    on_device = _ReportsAnotherDevice(torch.tensor(float("nan")), "cuda")
    assert on_device.device.type == "cuda"

    def reads():
        torch.tensor(2.0).item()  # a CPU tensor: waits for nothing on an accelerator run
        torch.tensor([1, 2]).tolist()
        on_device.item()  # an accelerator tensor: a real host sync

    with count_host_syncs(device="cuda") as syncs:
        reads()
    assert syncs.counts == {"aten._local_scalar_dense": 1}, syncs.counts
    assert "on_device.item()" in syncs.events[0][1], syncs.events
    with count_host_syncs(device="cpu") as syncs:  # the CPU stands in for the device: every read counts
        reads()
    assert syncs.counts == {"aten._local_scalar_dense": 2, "Tensor.tolist": 1}, syncs.counts
    with no_host_sync(device="cuda"):
        torch.tensor(2.0).item()
    with pytest.raises(HostSyncError, match="aten._local_scalar_dense"):
        with no_host_sync(device="cuda"):
            on_device.item()


class _Pinned(torch.Tensor):
    """A CPU tensor that says it is pinned (pinning needs an accelerator)."""

    def is_pinned(self, *args, **kwargs):
        return True


def test_a_copy_into_pageable_host_memory_is_a_blocking_copy_whatever_non_blocking_says():
    from deepspeed_offload_patch.hostsync import BLOCKING_COPY, READ, count_host_syncs

    source = _ReportsAnotherDevice(torch.ones(3), "cuda")
    pageable, pinned = torch.zeros(3), torch.zeros(3).as_subclass(_Pinned)
    with count_host_syncs(device="cuda") as syncs:
        pageable.copy_(source, non_blocking=True)  # pageable: returns once done
        pageable.copy_(source)
        pinned.copy_(source)  # asked to block
        pinned.as_subclass(torch.Tensor)  # not a copy
    assert syncs.by_kind[BLOCKING_COPY] == 3 and syncs.by_kind[READ] == 0, syncs.counts
    with count_host_syncs(device="cuda") as syncs:
        torch.Tensor.copy_(pinned, source, non_blocking=True)  # pinned and non-blocking: the host goes on
    assert syncs.total == 0, syncs.counts


def test_each_kind_of_host_wait_has_its_column(monkeypatch):
    """On CUDA the counter wraps the event, stream and device waits while it counts (counted before the call, so the
    call may fail here, without a GPU) and puts them back after."""
    from deepspeed_offload_patch.hostsync import KINDS

    before = (torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize, torch.cuda.synchronize)
    with count_host_syncs(device="cuda") as syncs:
        assert torch.cuda.synchronize is not before[2]
        for wait in (lambda: torch.cuda.synchronize(), lambda: torch.cuda.Event.synchronize(object()),
                     lambda: torch.cuda.Stream.synchronize(object())):
            try:
                wait()
            except Exception:  # no GPU (or no such object): counted all the same
                pass
    assert (torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize, torch.cuda.synchronize) == before
    assert syncs.by_kind == dict(zip(KINDS, (0, 1, 1, 1, 0))), syncs.counts
    assert syncs.total == 3 and syncs.reads == 0


def test_on_the_cpu_deepspeeds_wait_counts_when_a_copy_was_recorded_since_the_last(monkeypatch):
    """The CPU accelerator records no events: the counter counts DeepSpeed's own wait points instead, a wait only
    after a recorded copy (also when the copy was counted by an earlier counter), and puts the methods back."""
    import sys
    import types

    from deepspeed_offload_patch import hostsync

    class Optimizer:

        def _record_offload_copy(self):
            pass

        def _wait_for_offload_copies(self):
            pass

    module = types.ModuleType("fake_zero")
    module.Optimizer = Optimizer
    monkeypatch.setitem(sys.modules, "fake_zero", module)
    monkeypatch.setattr(
        hostsync, "_CPU_WAIT_POINTS",
        (("fake_zero", "Optimizer", "_record_offload_copy", "_wait_for_offload_copies", hostsync.OFFLOAD_WAIT_OP), ))
    original = Optimizer.__dict__["_wait_for_offload_copies"]
    first, second = Optimizer(), Optimizer()
    with count_host_syncs(device="cpu") as syncs:
        first._wait_for_offload_copies()  # nothing recorded: the GPU would not wait
        first._record_offload_copy()
        second._record_offload_copy()
    with count_host_syncs(device="cpu") as later:
        first._wait_for_offload_copies()
        first._wait_for_offload_copies()
        second._wait_for_offload_copies()
    assert syncs.total == 0 and later.by_kind["event wait"] == 2, (syncs.counts, later.counts)
    assert Optimizer.__dict__["_wait_for_offload_copies"] is original
    with count_host_syncs(device="cuda") as on_a_gpu:  # there the device's own waits are counted instead
        first._record_offload_copy()
        first._wait_for_offload_copies()
    assert on_a_gpu.total == 0


def test_the_run_device_is_deepspeeds_accelerator_or_the_cpu():
    from deepspeed_offload_patch.hostsync import run_device_type
    assert run_device_type() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_free_port_lies_below_the_ephemeral_range_and_binds(monkeypatch, tmp_path):
    """A launcher's port is drawn where no bind(0) or outgoing connection of another job can take it before the
    launcher binds it (a suite beside another lost its port so); where that range is empty, the kernel picks."""
    import socket

    from deepspeed_offload_patch.testing import launch

    floor = launch._ephemeral_floor()
    ports = {launch.free_port() for _ in range(20)}
    assert all(launch.PORT_FLOOR <= port < floor for port in ports), (sorted(ports), floor)
    assert len(ports) > 1  # drawn at random: two suites do not walk the same sequence
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))
    (tmp_path / "range").write_text(f"{launch.PORT_FLOOR}\t60999\n")
    monkeypatch.setattr(launch, "_EPHEMERAL_RANGE", str(tmp_path / "range"))
    assert launch.free_port() >= launch.PORT_FLOOR


def _what_the_rank_sees(name: str) -> tuple:
    import sys
    import deepspeed_offload_patch
    return os.environ.get(name), deepspeed_offload_patch.status().state, "torch" in sys.modules


@pytest.mark.parametrize("fork_server", [False, True])
@pytest.mark.parametrize("disable", ["0", "1"])
def test_each_rank_gets_the_call_s_environment_before_the_package_reads_it(fork_server, disable):
    """Started from the fork server (whose environment is its first caller's), a rank still reads this call's
    environment, and the package's switch in it decides, as with spawn."""
    from deepspeed_offload_patch.testing.launch import run_distributed
    env = {"DS_OFFLOAD_PATCH_TEST_MARK": f"call-{disable}", settings.DISABLE: disable}
    seen = run_distributed(_what_the_rank_sees,
                           2,
                           args=("DS_OFFLOAD_PATCH_TEST_MARK", ),
                           env=env,
                           fork_server=fork_server)
    state = "disabled" if disable == "1" else "applied"  # the rank has imported DeepSpeed
    assert seen == [(f"call-{disable}", state, True)] * 2, seen
