# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed's shared-memory comm op on the CPU accelerator: build it once before ranks start, and remove the files
its ranks leave in ``/dev/shm``.

Two behaviours of DeepSpeed's own meet every multi-rank job on the CPU accelerator:

* ``deepspeed.init_distributed`` JIT-builds the ``deepspeed_shm_comm`` op into ``TORCH_EXTENSIONS_DIR`` the first
  time a process needs it. When that first time is a multi-rank job, every rank goes to build it at once, and on a
  loaded machine one rank can load the ``.so`` before another has finished writing it (``cannot open shared object
  file``). :func:`build_op` builds it in one process, before any rank starts; the ranks then only load it.
* Each rank creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` (about 69 MB of RAM) and never
  removes it, even when the job ends normally. :func:`removes_leftovers` removes, after a job, the buffer files that
  appeared while it ran and that no live process maps or holds open: another job's files are untouched while it
  runs.

``python -m deepspeed_offload_patch.cpu_shm build`` builds the op (a no-op off the CPU accelerator, or where DeepSpeed
turns the op off); ``python -m deepspeed_offload_patch.cpu_shm clean`` removes every buffer file of this user that no
live process uses. Neither raises on a machine without ``/dev/shm`` or without DeepSpeed: they report and go on.
"""

import argparse
import contextlib
import os
import subprocess
import sys
import time
from typing import Iterator, List, Optional, Sequence, Set

#: Where DeepSpeed's shm op creates its files, and how their names start (``SHM_BUFFER_NAME`` in its ``shm.cpp``).
SHM_DIR = "/dev/shm"
BUFFER_PREFIX = "deepspeed_allreduce_buffer_"


def buffer_files(folder: str = SHM_DIR) -> Set[str]:
    """The paths of this user's DeepSpeed shm buffer files in ``folder``; empty where it does not exist."""
    try:
        names = os.listdir(folder)
    except OSError:
        return set()
    found = set()
    for name in names:
        if not name.startswith(BUFFER_PREFIX):
            continue
        path = os.path.join(folder, name)
        try:
            if os.stat(path).st_uid == os.getuid():
                found.add(path)
        except OSError:  # removed meanwhile
            continue
    return found


def in_use(paths: Set[str]) -> Set[str]:
    """Those of ``paths`` that a live process maps or holds open (read from ``/proc``; processes of other users, whose
    ``/proc`` entries cannot be read, cannot map this user's files either)."""
    if not paths:
        return set()
    used = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.rstrip("\n").split(maxsplit=5)
                    if len(fields) == 6 and fields[5] in paths:
                        used.add(fields[5])
            fd_dir = f"/proc/{pid}/fd"
            for fd in os.listdir(fd_dir):
                with contextlib.suppress(OSError):
                    target = os.readlink(os.path.join(fd_dir, fd))
                    if target in paths:
                        used.add(target)
        except OSError:  # gone, or another user's
            continue
    return used


def leftovers(before: Set[str], folder: str = SHM_DIR) -> List[str]:
    """The buffer files in ``folder`` that are not in ``before`` and that no live process uses, sorted."""
    new = buffer_files(folder) - set(before)
    return sorted(new - in_use(new))


def remove(paths: Sequence[str]) -> List[str]:
    """Remove ``paths``; returns those removed (one already gone is not an error)."""
    removed = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed


@contextlib.contextmanager
def removes_leftovers(folder: str = SHM_DIR) -> Iterator[List[str]]:
    """Around a job: on exit (also on an exception), remove the buffer files that appeared during it and that no
    live process uses. The yielded list is filled with the removed paths."""
    before = buffer_files(folder)
    removed: List[str] = []
    try:
        yield removed
    finally:
        removed.extend(remove(leftovers(before, folder)))


def build_op() -> str:
    """Build (or find built) DeepSpeed's CPU shm comm op in this process, as ``deepspeed.init_distributed`` would in
    each rank, and say what happened. Raises what DeepSpeed's build raises; returns without building where the
    accelerator is not the CPU or DeepSpeed marks the op incompatible (the ranks then use gloo alone)."""
    try:
        import deepspeed
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
    except ImportError as exc:
        return f"not needed: DeepSpeed does not import in this Python ({exc})"

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return f"not needed: the accelerator is {accelerator.device_name()}"
    builder = accelerator.create_op_builder("ShareMemCommBuilder")
    if builder is None:
        return f"not needed: DeepSpeed {deepspeed.__version__} has no CPU shm comm op"
    if not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return f"not needed: DeepSpeed {deepspeed.__version__} marks {builder.NAME} incompatible here (gloo alone)"
    start = time.monotonic()
    builder.load(verbose=False)
    where = os.environ.get("TORCH_EXTENSIONS_DIR", "torch's default extensions folder")
    return f"{builder.NAME} of DeepSpeed {deepspeed.__version__} ready in {where} ({time.monotonic() - start:.0f} s)"


def build_op_in_subprocess(env: Optional[dict] = None, prefix: str = "ds-offload-patch") -> bool:
    """Run :func:`build_op` in a child Python process (this one's interpreter, ``env``), so that a launcher's own
    process need not import DeepSpeed. Prints one line to stderr either way; returns whether it succeeded. Never
    raises: a failed build leaves the ranks to build the op themselves, as without this step."""
    command = [sys.executable, "-m", __name__, "build"]
    try:
        result = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        print(f"{prefix}: could not build DeepSpeed's CPU shm op before the launch: {exc}", file=sys.stderr)
        return False
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    if result.returncode != 0:
        tail = "\n".join(lines[-5:])
        print(
            f"{prefix}: could not build DeepSpeed's CPU shm op before the launch (exit {result.returncode}); the "
            f"ranks will try themselves:\n{tail}",
            file=sys.stderr)
        return False
    print(f"{prefix}: {lines[-1] if lines else 'shm op checked'}", file=sys.stderr, flush=True)
    return True


def main(argv: Optional[List[str]] = None) -> int:
    """``build``: exit 0 when the op is ready or not needed, 1 when its build failed. ``clean``: exit 0."""
    parser = argparse.ArgumentParser(prog="python -m deepspeed_offload_patch.cpu_shm",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("build", "clean"))
    args = parser.parse_args(argv)
    if args.action == "build":
        try:
            message = build_op()
        except Exception as exc:  # a compiler error: say so, exit non-zero
            print(f"building DeepSpeed's CPU shm op failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        print(message, flush=True)
        return 0
    removed = remove(leftovers(set()))
    size = len(removed)
    print(f"removed {size} DeepSpeed shm buffer file{'s' if size != 1 else ''} that no process uses"
          f"{':' if removed else ''}")
    for path in removed:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
