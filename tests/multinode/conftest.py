# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Two nodes on one machine: a real OpenSSH ``sshd`` and two host names that reach it.

The ``cluster`` fixture (one per module) starts ``sshd`` as a plain process (no system service): on a free port,
listening on 127.0.0.1 only, with its own host key, user key, ``authorized_keys``, pid file and log in a temporary
folder, and stops it afterwards. Clients reach it as ``node-a`` and ``node-b`` through an ssh config of their own
(``HostName 127.0.0.1``, the port, the key, no host-key prompts); OpenSSH reads ``~/.ssh/config`` from the password
database's home, not ``$HOME``, so an ``ssh`` first on the launchers' PATH adds ``-F`` with that config: DeepSpeed's
ssh check and pdsh's ssh both go through it, and the user's own ssh setup is never touched. The hostfile gives each
node 2 slots.

Nothing is skipped: without ``sshd``, ``ssh``, ``ssh-keygen`` or ``pdsh`` the fixture fails and names the apt packages
(``.ci/run`` installs them). Run as root, ``sshd`` needs its privilege-separation folder ``/run/sshd``, which the
fixture creates when missing.
"""

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterator

import pytest

from deepspeed_offload_patch.testing.launch import HANG_GUARD_S, free_port

HOSTS = ("node-a", "node-b")
SLOTS = 2
APT_PACKAGES = "openssh-server openssh-client pdsh"


@dataclasses.dataclass
class Cluster:
    """A running ``sshd`` and how to reach it as two nodes."""

    folder: str
    port: int
    hostfile: str
    ssh_config: str
    bin_dir: str  # holds the ``ssh`` that reads ssh_config; first on the launchers' PATH

    def env(self) -> Dict[str, str]:
        """PATH for a launcher: the ``ssh`` wrapper, then this Python's scripts, then the rest."""
        return {"PATH": os.pathsep.join([self.bin_dir, os.path.dirname(sys.executable), os.environ.get("PATH", "")])}


def _tool(name: str) -> str:
    found = shutil.which(name) or next(
        (os.path.join(d, name) for d in ("/usr/sbin", "/usr/bin") if os.path.exists(os.path.join(d, name))), None)
    if not found:
        pytest.fail(f"{name} is not installed: the two-node tests need a real sshd and pdsh "
                    f"(apt-get install -y {APT_PACKAGES}; .ci/run installs them)")
    return found


def _write(path: str, text: str, mode: int = 0o644) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def _start_sshd(sshd: str, ssh: str, folder: str, port: int, ssh_config: str) -> subprocess.Popen:
    """``sshd -D`` on ``port``; returns once ``ssh node-a true`` gets through. Fails with sshd's log if it exits,
    or after HANG_GUARD_S (a hang guard)."""
    log = os.path.join(folder, "sshd.log")
    process = subprocess.Popen([sshd, "-D", "-f", os.path.join(folder, "sshd_config"), "-E", log],
                               stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        if process.poll() is not None:
            with open(log) as f:
                pytest.fail(f"sshd exited with code {process.returncode}: {f.read()[-3000:]}")
        probe = subprocess.run([ssh, "-F", ssh_config, HOSTS[0], "true"], capture_output=True, text=True)
        if probe.returncode == 0:
            return process
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"hang guard: sshd on port {port} did not let ssh in within {HANG_GUARD_S:.0f} s: "
                        f"{probe.stderr[-2000:]}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    sshd, ssh, keygen = _tool("sshd"), _tool("ssh"), _tool("ssh-keygen")
    _tool("pdsh")
    if os.geteuid() == 0 and not os.path.isdir("/run/sshd"):
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd refuses to start as root without it
    folder = tempfile.mkdtemp(prefix="ds-two-nodes-")
    try:
        for key in ("host_key", "user_key"):
            subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(folder, key)], check=True)
        shutil.copy(os.path.join(folder, "user_key.pub"), os.path.join(folder, "authorized_keys"))
        port = free_port()
        _write(
            os.path.join(folder, "sshd_config"), "\n".join([
                f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {folder}/host_key", f"PidFile {folder}/sshd.pid",
                f"AuthorizedKeysFile {folder}/authorized_keys", "UsePAM no", "StrictModes no",
                "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password",
                "LogLevel ERROR", ""
            ]))
        ssh_config = os.path.join(folder, "ssh_config")
        _write(
            ssh_config, "\n".join([
                f"Host {' '.join(HOSTS)}", "  HostName 127.0.0.1", f"  Port {port}",
                f"  IdentityFile {folder}/user_key", "  IdentitiesOnly yes", "  StrictHostKeyChecking no",
                "  UserKnownHostsFile /dev/null", "  BatchMode yes", "  LogLevel ERROR", ""
            ]))
        bin_dir = os.path.join(folder, "bin")
        os.makedirs(bin_dir)
        _write(os.path.join(bin_dir, "ssh"), f'#!/bin/sh\nexec {ssh} -F {ssh_config} "$@"\n', 0o755)
        hostfile = os.path.join(folder, "hostfile")
        _write(hostfile, "".join(f"{host} slots={SLOTS}\n" for host in HOSTS))
        process = _start_sshd(sshd, ssh, folder, port, ssh_config)
        try:
            yield Cluster(folder, port, hostfile, ssh_config, bin_dir)
        finally:
            process.terminate()
            try:
                process.wait(timeout=HANG_GUARD_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
