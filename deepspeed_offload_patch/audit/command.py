# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""``ds-offload-patch audit [options] -- COMMAND``: host syncs per training phase in a user's own run, with budgets.

The command runs as ``ds-offload-patch run`` runs it (the patch applied in every Python process it starts, the
ranks of ``deepspeed``, ``torchrun`` and ``accelerate launch`` included), with
:mod:`~deepspeed_offload_patch.audit.rank` counting in each rank. Afterwards this process reads every rank's report,
checks the budgets and writes ``--json``.

Exit codes: the command's own code when it fails; 127 when it cannot be started; 1 when a budget is exceeded, or when
no rank counted a whole optimizer step (nothing was audited, which a CI gate must not take for a pass); 0 otherwise.
(The CLI exits 2 before this runs when no command is given.)
"""

import glob
import json
import os
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

from deepspeed_offload_patch import settings
from deepspeed_offload_patch.audit import rank as auditor
from deepspeed_offload_patch.audit import report as audit_report
from deepspeed_offload_patch.launcher import FORWARDED_ENV_FILE, deepspeed_env_problems, launch, patched_environment

PREFIX = "ds-offload-patch audit"


def _reports(folder: str) -> Tuple[List[Dict], bool]:
    """The rank reports a run left in ``folder`` and whether rank 0 gathered (and so printed) them. Rank 0's gathered
    file holds every rank; without it (the run ended early, or several nodes) the per-rank files of this node."""
    gathered = os.path.join(folder, auditor.REPORT)
    if os.path.exists(gathered):
        with open(gathered) as f:
            data = json.load(f)
        return data["ranks"], True
    reports = []
    for path in sorted(glob.glob(os.path.join(folder, "rank-*.json"))):
        with open(path) as f:
            reports.append(json.load(f))
    return sorted(reports, key=lambda r: r["rank"]), False


def _forward_through_pythonpath(env: Dict[str, str], folder: str) -> None:
    """Put ``folder`` first on ``env``'s PYTHONPATH with the bootstrap's forwarded-environment file: every
    ``DS_OFFLOAD_PATCH_*`` variable of ``env``. Launchers that give other nodes only PYTHONPATH (DeepSpeed's multi-node
    runner) so carry the audit and this run's switches to each rank that can read ``folder`` (every node on one
    machine or a shared file system); a rank that cannot still has the bootstrap behind it and is patched, unaudited."""
    with open(os.path.join(folder, FORWARDED_ENV_FILE), "w") as f:
        json.dump({k: v for k, v in env.items() if k.startswith(settings.NAME_PREFIX)}, f)
    env["PYTHONPATH"] = os.pathsep.join([folder] + [p for p in env["PYTHONPATH"].split(os.pathsep) if p])


def _run_once(command: List[str], steps: int, stop_after: bool, top: int, switches: Dict[str, str],
              quiet: bool) -> Tuple[int, List[Dict], bool]:
    with tempfile.TemporaryDirectory(prefix="ds-offload-patch-audit-") as folder:
        env = patched_environment()
        env.update(switches)
        env.update({
            settings.AUDIT_DIR: folder,
            settings.AUDIT_STEPS: str(steps),
            settings.AUDIT_STOP_AFTER: "1" if stop_after else "0",
            settings.AUDIT_TOP: str(max(10, top)),
            settings.AUDIT_PRINT: "0" if quiet else "1",
        })
        _forward_through_pythonpath(env, folder)
        code = launch(command, env, PREFIX)
        reports, printed = _reports(folder)
    return code, reports, printed


def audit(command: List[str],
          steps: int = 3,
          stop_after: bool = False,
          json_path: Optional[str] = None,
          budgets: Optional[Dict[str, Optional[int]]] = None,
          compare: bool = False,
          top: int = 3) -> int:
    """Run ``command`` audited (twice with ``compare``: patch disabled, then applied) and report; see the module doc
    for the exit codes. ``budgets`` maps ``max_backward_syncs``/``max_step_syncs``/``max_total_syncs`` to a limit per rank, phase and
    optimizer step (None: no limit); with ``compare`` they apply to the patched run."""
    budgets = budgets or {}
    for problem in deepspeed_env_problems(command):
        print(f"{PREFIX}: warning: {problem}", file=sys.stderr, flush=True)
    plan = [("unpatched", {settings.DISABLE: "1"}), ("patched", {settings.DISABLE: "0"})] if compare else [("run", {})]
    runs: Dict[str, List[Dict]] = {}
    codes: Dict[str, int] = {}
    for name, switches in plan:
        if compare:
            print(f"{PREFIX}: {name} run: {' '.join(command)}", flush=True)
        codes[name], runs[name], printed = _run_once(command, steps, stop_after, top, switches, quiet=compare)
        if runs[name] and not printed and not compare:  # rank 0 did not get to print it
            print(audit_report.table(runs[name], top), flush=True)
    if compare and all(runs.values()):
        print(audit_report.compare_table(runs, top), flush=True)

    for name, reports in runs.items():
        world = max((report["world_size"] for report in reports), default=0)
        if reports and (len(audit_report.nodes(reports)) > 1 or len(reports) < world):
            print((f"{name}:" if compare else "") + audit_report.node_table(reports), flush=True)
        if 0 < len(reports) < world:
            whose = "the" if name == "run" else f"the {name} run's"
            print(
                f"{PREFIX}: note: {whose} reports come from {len(reports)} of {world} ranks: a rank reports when "
                f"PYTHONPATH reaches it and its node can write this command's folder (one machine, or TMPDIR on a "
                f"file system every node shares); each node's own launcher (torchrun) needs its own audit command",
                flush=True)
    gated = "patched" if compare else "run"
    violations = audit_report.check_budgets(runs[gated], budgets, top) if runs[gated] else []
    failures = []
    for name in runs:
        which = "the command" if name == "run" else f"the {name} run"
        if codes[name] != 0:
            failures.append(f"{which} exited with code {codes[name]}")
        elif not any(report["steps"] for report in runs[name]):
            failures.append(f"{which} counted no DeepSpeed optimizer step (no engine.step() that advanced "
                            f"global_steps, nor a pipeline engine's train_batch(), in any rank): nothing was audited")
    failures.extend(str(v) for v in violations)
    if json_path:
        _write_json(json_path, command, steps, budgets, runs, codes, failures)
    for failure in failures:
        print(f"{PREFIX}: FAIL: {failure}", flush=True)
    if not failures:
        limits = " ".join(f"--{option.replace('_', '-')} {limit}" for option, limit in budgets.items()
                          if limit is not None)
        print(f"{PREFIX}: OK" + (f": every rank within {limits}" if limits else ""), flush=True)
    failed = [code for code in codes.values() if code != 0]
    return failed[0] if failed else (1 if failures else 0)


def _write_json(path: str, command, steps, budgets, runs, codes, failures) -> None:
    import deepspeed_offload_patch as dop
    data = {
        "package_version": dop.__version__,
        "command": command,
        "steps": steps,
        "budgets": budgets,
        "runs": {
            name: {
                "exit_code": codes[name],
                "ranks": reports
            }
            for name, reports in runs.items()
        },
        "failures": failures,
    }
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
