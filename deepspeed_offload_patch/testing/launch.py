# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Run a function on ``world_size`` spawned ranks with DeepSpeed's communication initialized (CPU: gloo).

The ranks meet through a ``file://`` store, see the environment DeepSpeed's launcher would give them (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, MASTER_ADDR, MASTER_PORT), and fail together: the first rank that raises stops
all of them, and a rank that does not finish in time is named in the error.
"""

import contextlib
import multiprocessing
import os
import pickle
import queue
import random
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["DistributedFailure", "free_port", "run_distributed"]


class DistributedFailure(AssertionError):
    """A rank raised, died or hung. The message holds that rank's traceback or names the ranks that hung."""


#: Where :func:`free_port` looks: below the kernel's ephemeral range, which every ``bind(0)`` and every outgoing
#: connection on the machine draws from.
PORT_FLOOR = 20000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_floor() -> int:
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no socket holds now, for a launcher's ``--master_port`` (or a server's).

    Between this call and the launcher binding the port, seconds pass on a loaded machine. A port from the kernel's
    ephemeral range (``bind(0)``) can be handed out again in that time, to any process that binds port 0 or opens a
    connection: gloo alone does both for every rank of every job, so a suite running beside another lost its port
    to the other's job (their ranks then met in one store). So the port is drawn at random from below that range,
    where only explicit choices like this one land, and checked to be bindable; where the range leaves no room
    below, the kernel picks."""
    rng = random.SystemRandom()
    top = _ephemeral_floor()
    for _ in range(100 if top > PORT_FLOOR else 0):
        port = rng.randrange(PORT_FLOOR, top)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_rank_environment(rank: int, world_size: int, port: int) -> None:
    """Set what a launcher sets for one rank. LOCAL_SIZE matters: the CPU accelerator counts devices by it."""
    os.environ.update({
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    })


def init_deepspeed_comm(init_file: Optional[str] = None) -> None:
    """Initialize ``deepspeed.comm`` from the environment, without JIT-building the shared-memory op (about a
    minute on first use; gloo alone is enough here)."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    kwargs = {}
    if init_file:
        kwargs = {
            "init_method": f"file://{init_file}",
            "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])
        }
    deepspeed.init_distributed(dist_backend=deepspeed.get_accelerator().communication_backend_name(),
                               verbose=False,
                               **kwargs)


def _leave_together() -> None:
    """Wait at a barrier until every rank is done: a rank that destroys its process group while a peer is still in
    gloo's ``connectFullMesh`` (a slow start on a loaded machine) fails that peer with "Connection closed by peer",
    although both did their work (measured: a rank whose call took no collective left before its peer had
    connected)."""
    import deepspeed.comm as dist
    if dist.is_initialized():
        dist.barrier()


def _rank_main(rank, world_size, port, init_file, fn, args, kwargs, results) -> None:
    try:
        init_rank_environment(rank, world_size, port)
        import torch
        torch.set_num_threads(1)  # world_size ranks share the cores
        init_deepspeed_comm(init_file)
        # Plain pickle: tensors sent through torch's queue reductions would live in shared memory that goes away
        # when this process exits.
        found = pickle.dumps(fn(*args, **kwargs))
        _leave_together()
        results.put((rank, True, found))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import deepspeed.comm as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


# A guard against a hang, not a budget: far above the slowest correct run measured (a test's ranks, or verify, on 2
# busy cores with cold caches: under 3 minutes), so a slow machine is never failed by it.
HANG_GUARD_S = 1800.0


def run_distributed(fn: Callable[..., Any],
                    world_size: int = 2,
                    args: Sequence = (),
                    kwargs: Optional[Dict[str, Any]] = None,
                    env: Optional[Dict[str, str]] = None,
                    timeout: float = HANG_GUARD_S,
                    fork_server: bool = False) -> List[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` fresh processes and return each rank's result, by rank.

    ``fn``, its arguments and its results must pickle (``fn`` defined at module level, or a bound method of an
    importable class). ``env`` is added to each rank's environment before anything is imported there (the
    parent's environment is set around the spawn, then restored).

    ``fork_server=True`` (where the platform has one; Linux) starts the ranks from a fork server that has imported
    torch and nothing else, instead of a fresh interpreter each: about 2.5 s of CPU less per rank, most of a small
    job's time (the test suite's jobs). Not for a caller whose ``__main__`` (a script, or ``python -m`` one of this
    package's modules) imports this package: every rank imports the caller's ``__main__`` before its environment is
    set, in the environment of the fork server's first caller, and this package's switches are read when it is
    imported. pytest's ``__main__`` imports nothing of it.

    Raises:
        DistributedFailure: a rank raised (its traceback is in the message), died without a result, or did not
            finish within ``timeout`` seconds (the ranks that hung are named). All ranks are stopped first.
    """
    ctx = _context(fork_server)
    results = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ds-offload-patch-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        rank_args = [(rank, world_size, port, init_file, fn, tuple(args), dict(kwargs or {}), results)
                     for rank in range(world_size)]
        if ctx.get_start_method() == "forkserver":
            procs = [_forked_rank(ctx, env or {}, rank_arg) for rank_arg in rank_args]
        else:
            procs = [ctx.Process(target=_rank_main, args=rank_arg, daemon=True) for rank_arg in rank_args]
        # A spawned child unpickles `fn` (importing its module) before any code of ours runs there, so `env` must
        # already be in the environment it inherits.
        with _environment(env or {}):
            for proc in procs:
                proc.start()
        try:
            return _collect(procs, results, timeout, getattr(fn, "__qualname__", repr(fn)))
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()


#: Imported once, in the fork server (``fork_server=True``): each rank then begins with torch loaded instead of
#: importing it. Nothing of this package or of DeepSpeed is imported there: what the switches decide happens in each
#: rank, after its environment is set. torch's compiler stack is there too: DeepSpeed's engine imports it (torch's
#: Adam does, and DeepSpeed's Muon module calls torch.compile at import), about 3 s of a small job's 4 on one core;
#: it starts no thread on import, and reads only torch's own TORCH*/TORCHDYNAMO*/TORCHINDUCTOR* variables.
PRELOAD = ["torch", "torch._dynamo", "torch._inductor.compile_fx"]

# A rank started by the fork server: the server's environment and sys.path are those of its first caller, so the
# rank takes this call's before it unpickles anything (unpickling `fn` imports its module, and with it this package).
_FORKED_RANK = """
import os, pickle, sys
os.environ.clear()
os.environ.update(environ)
sys.path[:] = path
from deepspeed_offload_patch.testing.launch import _rank_main
_rank_main(*pickle.loads(payload), results)
"""


def _context(fork_server: bool):
    """The fork server when asked for and the platform has one, else spawn: both start each rank from a clean
    interpreter state, never a copy of the caller's."""
    if fork_server and "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


def _forked_rank(ctx, env: Dict[str, str], rank_args: tuple):
    """A process that runs :func:`_rank_main` with ``rank_args`` in this process's environment plus ``env``."""
    *payload, results = rank_args
    scope = {
        "environ": dict(os.environ, **env),
        "path": list(sys.path),
        "payload": pickle.dumps(tuple(payload)),
        "results": results,
    }
    return ctx.Process(target=exec, args=(_FORKED_RANK, scope), daemon=True)


@contextlib.contextmanager
def _environment(env: Dict[str, str]):
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _collect(procs, results, timeout: float, what: str) -> List[Any]:
    world_size = len(procs)
    done: Dict[int, Any] = {}
    failed: Dict[int, str] = {}
    deadline = time.monotonic() + timeout
    grace_end = deadline
    while len(done) + len(failed) < world_size:
        if failed and time.monotonic() > grace_end:
            break
        try:
            rank, ok, payload = results.get(timeout=0.5)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in done and r not in failed and p.exitcode is not None]
            if dead and not failed:
                # Give a result that was put just before exiting a moment to arrive.
                time.sleep(1.0)
                if results.empty():
                    codes = ", ".join(f"rank {r} (exit code {procs[r].exitcode})" for r in dead)
                    raise DistributedFailure(f"{codes} exited without a result")
            if time.monotonic() > deadline:
                hung = [r for r in range(world_size) if r not in done and r not in failed]
                raise DistributedFailure(f"rank(s) {hung} of {what} did not finish within {timeout:.0f} s (the hang "
                                         f"guard of run_distributed; timeout= sets it)")
            continue
        if ok:
            done[rank] = pickle.loads(payload)
        else:
            if not failed:
                # The other ranks usually fail soon after, often only because this one stopped talking: wait a
                # little to report every rank's error, the first one first.
                grace_end = time.monotonic() + 3.0
            failed[rank] = payload
    if failed:
        reports = "\n".join(f"rank {rank} of {world_size} failed:\n{text}" for rank, text in failed.items())
        raise DistributedFailure(reports)
    return [done[rank] for rank in range(world_size)]
