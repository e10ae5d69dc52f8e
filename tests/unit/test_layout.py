# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The package's modules import one way: each module sits on a floor, and every import of the package's own code
(at module level or inside a function) goes to a lower floor. So there is no import cycle, the host-sync counter and
the other low modules import nothing above them, and a new module has to be given its place here."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "deepspeed_offload_patch"

FLOORS = {
    # What DeepSpeed's methods are replaced with (each change's ``methods``; a default's ``default``), the data, and
    # mechanisms that know nothing of the rest.
    0: ("releases", "fingerprints", "source_digest", "log", "waits", "import_hook", "cpu_shm", "testing.launch",
        "audit.report", "states", "testing.zero3_gather", "changes.overflow_flag.methods", "changes.grad_norm.methods",
        "changes.skipped_step.methods", "changes.grad_accumulation.methods", "changes.event_waits.methods",
        "changes.several_backwards.methods", "changes.zero3_overflow.methods", "changes.invalid_norm.methods",
        "changes.rank_agreement.methods", "changes.bf16_check.default"),
    1: ("hostsync", ),  # the host-wait counter (on the kinds of wait that ``waits`` names)
    # The switches; the launch of a patched command (DeepSpeed's shm op built first, its /dev/shm files removed
    # after); the behavioural probes of the changes that have one; the line said for a skipped step.
    2: ("settings", "launcher", "changes.overflow_flag.probe", "changes.skipped_step.probe",
        "changes.grad_accumulation.probe", "changes.event_waits.probe", "changes.several_backwards.probe",
        "changes.zero3_overflow.probe", "changes.invalid_norm.probe", "changes.rank_agreement.probe", "audit.counts",
        "skip_log"),
    3: ("changes.record", ),  # what a change declares
    4: ("guard", ),  # the decision whether to patch, given a change
    5: ("changes.event_waits", "changes.overflow_flag", "changes.grad_norm", "changes.skipped_step",
        "changes.grad_accumulation", "changes.several_backwards", "changes.zero3_overflow", "changes.invalid_norm",
        "changes.rank_agreement", "changes.bf16_check"),  # one record each
    6: ("changes", ),  # the registry
    # What status() reports; what a change installs on a class; what one inf does to a job, as recorded.
    7: ("patch_status", "replacements", "one_inf"),
    8: ("patcher", ),  # applies and reverts, keeps the status
    # The package's face; what runs in each audited rank; diffs; helpers (and what the installed DeepSpeed does, for
    # verify and the harness); a job's defects from its config.
    9: ("", "audit.rank", "diffs", "testing", "testing.installed", "affected"),
    10: ("testing.models", "audit.command"),
    11: ("testing.equivalence", "testing.oracle", "audit"),
    12: ("verify", "demo", "bench_report", "testing.outcomes"),
    13: ("bench", "testing.skips"),
    14: ("cli", ),
    15: ("__main__", "_bootstrap.sitecustomize"),
}
FLOOR = {(f"{PACKAGE}.{name}" if name else PACKAGE): floor for floor, names in FLOORS.items() for name in names}


def modules():
    """``{module name: path}`` of every module of the package."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[module[:-len(".__init__")] if module.endswith(".__init__") else module] = path
    return found


def imports(path, known):
    """The package's own modules that the file at ``path`` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE)
    return found


def test_every_module_has_a_floor():
    assert sorted(set(modules()) - set(FLOOR)) == [], "give each new module a floor in FLOORS"
    assert sorted(set(FLOOR) - set(modules())) == [], "FLOORS names a module that does not exist"


def test_every_import_goes_down():
    known = modules()
    upward = [(module, target) for module, path in known.items() for target in imports(path, known) - {module}
              if FLOOR[target] >= FLOOR[module]]
    assert upward == [], upward


def test_an_upward_import_is_caught(tmp_path):
    path = tmp_path / "guard.py"
    path.write_text("from deepspeed_offload_patch.testing import RaisingBoolTensor\n")
    known = modules()
    assert imports(str(path), known) == {f"{PACKAGE}.testing"}
    assert FLOOR[f"{PACKAGE}.testing"] >= FLOOR[f"{PACKAGE}.guard"]


#: The test harness may be longer: it is one place that runs every kind of training the suite compares.
LONG = {f"{PACKAGE}.testing.equivalence"}


def test_no_module_is_over_400_lines():
    long = {module: sum(1 for _ in open(path)) for module, path in modules().items() if module not in LONG}
    assert {module: lines for module, lines in long.items() if lines > 400} == {}
