# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Unpack a DeepSpeed release's sdist into a source tree to build, with its ``version.txt`` changed and, optionally,
the tracker of ``stage_1_and_2.py`` rewritten; print the tree's path.

It stands for what the package will meet after the last release it was tested on: a later release or a dev build
with the same code (``none``), DeepSpeed's own fix written in its own words (``fixed-differently``: other names,
an in-place ``logical_or_``, ``has_overflow`` rewritten too; and the skipped-step defect fixed in ``step()``'s
overflow branch, which drops the compact gradient buffers itself), or a tracker changed in a way that still reads the
host (``truth-test``: ``.item()`` on the check's result).

    python ci/variants.py 0.19.8 0.19.9 none
    python ci/variants.py 0.19.8 0.20.0 fixed-differently
"""

import argparse
import os
import sys
import tarfile
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "ci"))

from gen_fingerprints import TARGET  # noqa: E402
from make_patches import replace_methods  # noqa: E402
from sdists import DEFAULT_CACHE, sdist_path  # noqa: E402

EDITS = {
    "truth-test": {
        "update_offload_overflow_tracker":
        """
        def update_offload_overflow_tracker(self, grad):
            if grad is None or not self.check_grad_overflow:
                return
            if self._has_inf_or_nan(grad.data).any().item():
                self.local_overflow = True
        """,
    },
    "fixed-differently": {
        "update_offload_overflow_tracker":
        """
        def update_offload_overflow_tracker(self, grad):
            # Keep the overflow state on the device; has_overflow reads it once, after its all-reduce.
            if not getattr(self, "check_grad_overflow", True) or grad is None:
                return
            grad_has_overflow = self._has_inf_or_nan(grad.data).bool()
            if torch.is_tensor(self.local_overflow):
                self.local_overflow.logical_or_(grad_has_overflow.to(self.local_overflow.device))
            else:
                self.local_overflow = grad_has_overflow.to(get_accelerator().current_device_name()).clone()
        """,
        "has_overflow":
        """
        def has_overflow(self, partition_gradients=True):
            device = get_accelerator().current_device_name()
            if not self.cpu_offload:
                overflow_state = self.has_overflow_partitioned_grads_serial().byte().to(device)
            elif torch.is_tensor(self.local_overflow):
                overflow_state = self.local_overflow.to(device=device, dtype=torch.uint8).view(1)
            else:
                overflow_state = torch.tensor([int(self.local_overflow)], dtype=torch.uint8, device=device)
            dist.all_reduce(overflow_state, op=dist.ReduceOp.MAX, group=self.dp_process_group)
            self._model_parallel_all_reduce(tensor=overflow_state, op=dist.ReduceOp.MAX)
            return bool(overflow_state[0].item())
        """,
    },
}

# Edits inside a method too long to rewrite here: (the text DeepSpeed's file has, what it becomes), each found once.
LINE_EDITS = {
    "fixed-differently":
    (("            if self.cpu_offload:\n                self.reset_cpu_buffers()\n            else:\n",
      "            if self.cpu_offload:\n                self.reset_cpu_buffers()\n"
      "                # The compact fp32 gradient buffers hold the skipped step's inf/NaN.\n"
      "                for k in list(self.averaged_gradients.keys()):\n"
      "                    self.averaged_gradients[k] = None\n            else:\n"), ),
}


def make_tree(base: str, version: str, edit: str, sdists: str, into: str) -> str:
    """Unpack DeepSpeed ``base``'s sdist under ``into``, set ``version``, apply ``edit``; return the tree."""
    with tarfile.open(sdist_path(sdists, base)) as tar:
        tar.extractall(into, filter="data")
    tree = os.path.join(into, f"deepspeed-{base}")
    with open(os.path.join(tree, "version.txt"), "w") as f:
        f.write(version + "\n")
    if edit != "none":
        path = os.path.join(tree, TARGET)
        with open(path) as f:
            source = f.read()
        texts = {
            name: textwrap.indent(textwrap.dedent(text).lstrip("\n"), "    ")
            for name, text in EDITS[edit].items()
        }
        source = replace_methods(source, texts)
        for old, new in LINE_EDITS.get(edit, ()):
            if source.count(old) != 1:
                raise SystemExit(f"{edit}: the text to edit is not once in {TARGET} of {base}")
            source = source.replace(old, new)
        with open(path, "w") as f:
            f.write(source)
    return tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the release whose sdist to start from")
    parser.add_argument("version", help="the version to write into version.txt")
    parser.add_argument("edit", choices=["none", *EDITS])
    parser.add_argument("--sdists", default=DEFAULT_CACHE, help="the sdist cache (default: %(default)s)")
    parser.add_argument("--into", default=None, help="where to unpack (default: a new temporary folder)")
    args = parser.parse_args()
    os.makedirs(args.sdists, exist_ok=True)
    print(make_tree(args.base, args.version, args.edit, args.sdists, args.into or tempfile.mkdtemp(prefix="ds-")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
