# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The upstream watch's check, run in an environment with a DeepSpeed to watch (the newest release, a pre-release,
DeepSpeed's git main) and this package installed: ``ds-offload-patch status --json``, then ``verify``, then one row of
the one-inf outcome table.

It passes when the fix is active (``applied`` or ``upstream-fixed``), ``verify`` passes, and every stage with
``offload_optimizer``, in bf16 and in fp32, skips the step of one inf on one rank, patched (:data:`ROW`, trained by
:mod:`deepspeed_offload_patch.testing.outcomes` in one launch of 2 ranks). It fails (exit 1) when the state is
anything else, ``verify`` fails or a cell of the row comes out otherwise (NaN weights, a crash, ranks that disagree),
with one line that names the DeepSpeed, the state and each method whose code is a form the package does not know (its
fingerprint is new): the first step of the runbook in ``ci/README.md``, "A new DeepSpeed form". ``--report FILE`` also writes that text, with the status, as Markdown (the
body of the issue the workflow opens).

    python ci/upstream_watch.py [--report watch.md]
"""

import argparse
import json
import subprocess
import sys
from typing import Dict, List, Tuple

from deepspeed_offload_patch.changes import CHANGES, OTHERS, UPSTREAM

TEMPLATE = "ci/templates/upstream-watch.yml"
#: The outcome table's row the watch trains: ZeRO-1, 2, 3, bf16 (the check on) and fp32, an inf on rank 0.
ROW = ("s1-bf16-ga1-inf-one", "s1-fp32-ga1-inf-one", "s2-bf16-ga1-inf-one", "s2-fp32-ga1-inf-one",
       "s3-bf16-ga1-inf-one", "s3-fp32-ga1-inf-one")


def template_command(path: str) -> List[str]:
    """The watch's command as the workflow at ``path`` runs it (its ``run:`` line that calls this script)."""
    import shlex
    for line in open(path):
        line = line.strip()
        line = line[len("run: "):] if line.startswith("run: ") else line
        if line.startswith("python ci/upstream_watch.py"):
            return shlex.split(line)
    raise LookupError(f"{path} runs no python ci/upstream_watch.py")


def status() -> Dict:
    """``ds-offload-patch status --json`` of this environment (its exit code says the same as the state)."""
    out = subprocess.run([sys.executable, "-m", "deepspeed_offload_patch", "status", "--json"],
                         capture_output=True,
                         text=True).stdout
    return json.loads(out[out.index("{"):])


def fingerprints(methods: Dict[str, str]) -> List[str]:
    """The methods whose finding says their code is no form the package knows, each with its new fingerprint."""
    import importlib

    new = [key for key, finding in methods.items() if finding not in ("patchable", "fixed", "ours")]
    if not new:
        return []
    from deepspeed_offload_patch.guard import fingerprint
    # A key is a method's name on ZeRO-1/2's class, Class.name on another's.
    where = {change.key(name): (change.target, name) for change in CHANGES for name in change.method_names}
    found = []
    for key in new:
        target, name = where.get(key, (UPSTREAM.target, key))
        cls = getattr(importlib.import_module(target.module), target.name)
        found.append(f"{key} ({methods[key]}, fingerprint {fingerprint(cls.__dict__[name])})" if name in
                     cls.__dict__ else f"{key} ({methods[key]})")
    return found


def verify() -> Tuple[int, str]:
    result = subprocess.run([sys.executable, "-m", "deepspeed_offload_patch", "verify"],
                            capture_output=True,
                            text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("verify:")]
    return result.returncode, "\n".join(lines) or result.stdout[-2000:] + result.stderr[-2000:]


def one_inf_row() -> Dict[str, str]:
    """The outcome of each cell of :data:`ROW` here, patched, by name (``"crash: ..."`` and the like)."""
    from deepspeed_offload_patch.testing import outcomes
    from deepspeed_offload_patch.testing.launch import DistributedFailure, run_distributed

    cells = [cell for cell in outcomes.core_cells() if cell.name in ROW]
    try:
        ranks = run_distributed(outcomes.train_row, 2, args=(cells, ), timeout=outcomes.HANG_S)
    except DistributedFailure as failure:
        return {cell.name: f"ranks-disagree: {str(failure).splitlines()[0][:200]}" for cell in cells}
    return {cell.name: ": ".join(outcomes.classify([rank[cell.name] for rank in ranks])) for cell in cells}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", metavar="FILE", help="also write the verdict and the status as Markdown")
    args = parser.parse_args()
    found = status()
    version, state = found.get("deepspeed_version"), found["state"]
    problems = []
    if state not in UPSTREAM.good_states:
        new = fingerprints(found.get("methods", {}))
        problems.append(f"state {state}: {found['reason']}" + (f"; new forms: {', '.join(new)}" if new else ""))
    # Every other change in one of its good states (in effect, not needed, or off by the environment's choice).
    for change in OTHERS:
        other = found.get(change.state_key, "off")
        if other not in change.good_states:
            problems.append(f"{change.title} {other}: {found.get(change.reason_key, '')}")
        else:
            state += f", {change.title} {other}"
    code, verified = verify()
    if code != 0:
        problems.append(f"verify failed: {verified.splitlines()[-1] if verified else code}")
    row = one_inf_row()
    wrong = {name: outcome for name, outcome in row.items() if not outcome.startswith("skipped")}
    if wrong:
        problems.append("one inf is not skipped: " + "; ".join(f"{name}: {outcome}"
                                                               for name, outcome in wrong.items()))
    verified += "\n" + "\n".join(f"one inf, {name}: {outcome}" for name, outcome in row.items())
    if problems:
        line = f"upstream watch: FAIL: DeepSpeed {version}: " + "; ".join(problems)
    else:
        line = (f"upstream watch: OK: DeepSpeed {version} is {state}; verify passes; one inf is skipped at ZeRO-1, 2 "
                "and 3 in bf16 and fp32")
    print(line)
    if args.report:
        with open(args.report, "w") as f:
            f.write(f"{line}\n\nNext: the runbook \"A new DeepSpeed form\" in ci/README.md.\n\n"
                    f"```json\n{json.dumps(found, indent=2, sort_keys=True)}\n```\n\n```\n{verified}\n```\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
