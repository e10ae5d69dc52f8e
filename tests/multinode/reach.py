# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Whether the patch reached this rank, without training: loads DeepSpeed's ZeRO module (where the patch applies)
and writes ``rank-<RANK>.json`` into the folder given as its argument (script arguments reach every node):
the package's state if something loaded it (it never imports the package itself), else ``not loaded``.

    deepspeed --hostfile HOSTFILE ... reach.py FOLDER
"""

import json
import os
import socket
import sys

folder = [arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")][0]
import deepspeed.runtime.zero.stage_1_and_2  # noqa: E402,F401

package = sys.modules.get("deepspeed_offload_patch")
found = {
    "rank": int(os.environ["RANK"]),
    "node": int(os.environ.get("CROSS_RANK", os.environ.get("GROUP_RANK", "-1"))),
    "host": socket.gethostname(),
    "state": package.status().state if package is not None else "not loaded",
    "disable": os.environ.get("DS_OFFLOAD_PATCH_DISABLE"),
}
with open(os.path.join(folder, f"rank-{found['rank']}.json"), "w") as f:
    json.dump(found, f)
