# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The unified diffs of ``patches/`` (shipped in the package as ``_patches/``), looked up by DeepSpeed release."""

import json
import os
from typing import Optional, Tuple

from packaging.version import Version

from deepspeed_offload_patch.changes import UPSTREAM, by_name

_HERE = os.path.dirname(os.path.abspath(__file__))
# Installed: copied into the package at build time. Source checkout: the repository's patches/.
_CANDIDATES = (os.path.join(_HERE, "_patches"), os.path.join(os.path.dirname(_HERE), "patches"))


def patches_dir() -> str:
    """The folder of the diffs: one folder per change, named as the change (``patches/<name>/``)."""
    for path in _CANDIDATES:
        if os.path.isfile(os.path.join(path, UPSTREAM.name, "index.json")):
            return path
    raise LookupError("the diffs are not installed with this copy of deepspeed_offload_patch")


def diff_for(version: str, part: str = UPSTREAM.name) -> Tuple[str, str]:
    """``(file name, diff text)`` of the change named ``part`` (by default the upstream one) for DeepSpeed
    ``version`` (its release part). Raises LookupError if there is none."""
    from deepspeed_offload_patch.guard import release_of

    directory = os.path.join(patches_dir(), part)
    if not os.path.isfile(os.path.join(directory, "index.json")):
        raise LookupError(f"no diffs for {part}")
    with open(os.path.join(directory, "index.json")) as f:
        index = json.load(f)
    release = release_of(version)
    name = index.get(str(release)) if release is not None else None
    if name is None:
        raise LookupError(f"no diff of {part} for DeepSpeed {version}; diffs exist for {min(index, key=Version)} to "
                          f"{max(index, key=Version)}")
    with open(os.path.join(directory, name)) as f:
        return name, f.read()


def diff_for_installed(part: str = UPSTREAM.name) -> Tuple[str, str]:
    """:func:`diff_for` the installed DeepSpeed. For a DeepSpeed newer than the releases tested, the diff of the last
    tested release whose methods it has, byte for byte (AST fingerprints); it imports DeepSpeed's ZeRO module to
    find out. Raises LookupError when DeepSpeed is missing or has no diff."""
    from deepspeed_offload_patch.guard import newer_than_tested
    from deepspeed_offload_patch.patcher import deepspeed_version

    version = deepspeed_version()
    if version is None:
        raise LookupError("DeepSpeed is not installed")
    if newer_than_tested(version):
        release = release_with_the_same_methods(part)
        if release is not None:
            return diff_for(release, part)
    return diff_for(version, part)


def release_with_the_same_methods(part: str = UPSTREAM.name) -> Optional[str]:
    """The last tested release whose methods (those the change named ``part`` replaces or reads, in the installed
    class's form) have the fingerprints of the installed DeepSpeed's originals; None when there is none."""
    import importlib

    from deepspeed_offload_patch import guard, patcher

    change = by_name(part)
    cls = getattr(importlib.import_module(change.target.module), change.target.name)
    form = change.form_for(cls)
    names = form.methods + form.witnesses
    originals = patcher.originals()
    common = guard.releases_shipping(
        {change.key(name): originals.get(change.key(name), cls.__dict__.get(name))
         for name in names})
    return max(common, key=Version) if common else None
