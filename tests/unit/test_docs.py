# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The documents a user reads first hold what the code does: every CLI option is on docs/cli.md, README.md stays
short, every relative link leads to a file, and each number README takes from a measurement equals the one in the file
the measurement wrote (the transcripts themselves run as tests: conftest.py)."""

import os
import re
import sys

from unit.common import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_cli_option_is_documented():
    result = run_command([sys.executable, os.path.join(ROOT, "ci", "cli_docs.py"), "--check"], cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_missing_option_fails_the_docs_check(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "ci"))
    import cli_docs
    text = open(cli_docs.PAGE).read().replace("--max-backward-syncs", "--max-backward")
    assert "ds-offload-patch audit: --max-backward-syncs is not documented" in cli_docs.missing(text)


def test_readme_is_short_and_answers_first():
    text = open(os.path.join(ROOT, "README.md")).read()
    lines = text.splitlines()
    assert len(lines) <= 200, len(lines)
    first = "\n".join(lines[:40])
    for heading in ("Are you affected?", "What you gain", "Install", "Use", "Is it working?"):
        assert heading in first, heading
    # The first screen shows how to know it works: the gate's command and what it prints.
    assert "$ ds-offload-patch check" in first and "ds-offload-patch check: OK" in first, first


def _markdown_files() -> list:
    listed = run_command(["git", "ls-files", "*.md"], cwd=ROOT)
    if listed.returncode == 0 and listed.stdout.strip():
        return listed.stdout.split()
    # An unpacked sdist has no git: its Markdown files are the tracked ones (check-manifest keeps them equal).
    return [
        os.path.relpath(os.path.join(folder, name), ROOT) for folder, _, names in os.walk(ROOT) for name in names
        if name.endswith(".md") and "/." not in folder and "build" not in folder
    ]


def test_every_relative_link_in_every_document_leads_to_a_file():
    names = _markdown_files()
    assert "README.md" in names and "tests/README.md" in names, names
    for name in names:
        text = open(os.path.join(ROOT, name)).read()
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(name), target))
            assert os.path.exists(path), f"{name} links to {target}, which does not exist"


def _between(text: str, name: str) -> str:
    return text.split(f"<!-- {name}:start -->\n", 1)[1].split(f"<!-- {name}:end -->", 1)[0]


def test_the_gpu_numbers_are_the_measured_ones():
    # docs/gpu.md's table is what the benchmark wrote on the GPU (docs/gpu-check/bench.json), not a copy by hand.
    import json

    from deepspeed_offload_patch.bench import render_cuda_table

    with open(os.path.join(ROOT, "docs", "gpu-check", "bench.json")) as f:
        measured = json.load(f)["results"]
    with open(os.path.join(ROOT, "docs", "gpu.md")) as f:
        assert _between(f.read(), "gpu") == render_cuda_table(measured)
    whole = {r["n"]: r["cuda"]["whole"]["cudaStreamSynchronize"] for r in measured["patched+grad-norm"]}
    assert len(whole) > 1 and len(set(whole.values())) == 1, whole


def _readme_section(heading: str) -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    return text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _gain_row(what: str) -> str:
    rows = [line for line in _readme_section("What you gain").splitlines() if line.startswith(f"| {what}")]
    assert len(rows) == 1, what
    return rows[0]


def test_what_you_gain_on_the_cpu_is_the_demo_s_transcript():
    """The counts README's gain table states are those of the demo's transcript below it, which runs as a test."""
    demo = _readme_section("What the demo shows").split("```console\n", 1)[1].split("```", 1)[0]
    counts = {}
    for line in demo.splitlines():
        cells = line.split()
        if cells[:1] in (["unpatched"], ["patched"]) and cells[1] == "0":
            numbers = [int(cell) for cell in cells[3:]]
            # boundary backward, other backward, step(): 4 steps each; the first step skips nothing.
            counts[cells[0]] = (numbers[0], numbers[0] + numbers[4] + numbers[8])
    (boundary_before, whole_before), (boundary_after, whole_after) = counts["unpatched"], counts["patched"]
    assert f"{boundary_before} → {boundary_after}" in _gain_row("host syncs per boundary backward")
    assert f"{whole_before} → {whole_after}; {whole_after} at any size" in _gain_row("host syncs per optimizer step")


def test_what_you_gain_on_the_gpu_is_the_measured_one():
    """The GPU row counts every kind of host wait the profiler recorded (stream, event and device syncs), per stage,
    from docs/gpu-check/bench.json at N = 398."""
    import json

    with open(os.path.join(ROOT, "docs", "gpu-check", "bench.json")) as f:
        measured = json.load(f)["results"]
    kinds = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")

    def waits(variant: str, phase: str, stage: int, keys=kinds) -> int:
        (found, ) = {
            sum(r["cuda"][phase][key] for key in keys)
            for r in measured[variant] if r["n"] == 398 and r["stage"] == stage
        }
        return found

    row = _gain_row("on one H200 GPU")
    assert "398 tensors" in row, row
    for stage in (1, 2):
        before, after = waits("unpatched", "whole", stage), waits("patched+grad-norm", "whole", stage)
        assert f"ZeRO-{stage} {before} → {after}" in row, (stage, before, after, row)
    events = waits("patched+grad-norm", "whole", 2, ("cudaEventSynchronize", ))
    assert f"{events} of them event waits" in row, row
    before, after = (waits(v, "backward", 1, ("cudaStreamSynchronize", )) for v in ("unpatched", "patched+grad-norm"))
    assert f"boundary backward {before} → {after}" in row, row


def test_the_cpu_benchmark_table_is_the_measured_one():
    """docs/benchmark.md's table is what ``bench --readme docs/benchmark.md`` rendered from the JSON it wrote beside
    it; README's time ratio range is that JSON's."""
    import json

    from deepspeed_offload_patch.bench import render_readme

    with open(os.path.join(ROOT, "docs", "benchmark.json")) as f:
        data = json.load(f)
    with open(os.path.join(ROOT, "docs", "benchmark.md")) as f:
        assert _between(f.read(), "bench") == render_readme(data)
    unpatched, patched = data["results"]["unpatched"], data["results"]["patched"]
    ratios = [u["backward_s"] / p["backward_s"] for u, p in zip(unpatched, patched)]
    row = _gain_row("time on the CPU")
    assert f"({min(ratios):.1f}x – {max(ratios):.1f}x per configuration" in row, row
    with open(os.path.join(ROOT, "docs", "benchmark.md")) as f:
        assert f"range from {min(ratios):.1f}x to {max(ratios):.1f}x" in f.read()
    whole = {r["whole_syncs"] for r in data["results"]["patched+grad-norm"] if r["mode"] == "bf16-check"}
    assert len(whole) == 1 and f"; {whole.pop()} at any size" in _gain_row("host syncs per optimizer step")


def test_the_reason_for_a_later_build_is_the_one_releases_md_shows():
    """docs/releases.md quotes the reason a build newer than the releases tested gets (0.19.8's code, numbered 0.19.9):
    the guard gives exactly that text for the installed DeepSpeed's class (the default suite's 0.19.8), unpatched."""
    program = """
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed_offload_patch.changes import UPSTREAM
print(UPSTREAM.decide(UPSTREAM, DeepSpeedZeroOptimizer, "0.19.9").reason)
"""
    result = run_command([sys.executable, "-c", program], env={"DS_OFFLOAD_PATCH_DISABLE": "1"})
    assert result.returncode == 0, result
    reason = result.stdout.strip().splitlines()[-1]
    with open(os.path.join(ROOT, "docs", "releases.md")) as f:
        assert f"```\n{reason}\n```" in f.read(), reason


def test_the_upstream_report_s_change_applies_to_deepspeed_0_19_8(tmp_path):
    """docs/upstream/skipped-step.md proposes its change as a diff to apply at the top of a 0.19.8 checkout: it applies
    to the installed 0.19.8's file as it stands."""
    import importlib.util
    import shutil

    with open(os.path.join(ROOT, "docs", "upstream", "skipped-step.md")) as f:
        change = f.read().split("```diff\n", 1)[1].split("```", 1)[0]
    target = "deepspeed/runtime/zero/stage_1_and_2.py"
    site = os.path.dirname(os.path.dirname(importlib.util.find_spec("deepspeed").origin))
    (tmp_path / os.path.dirname(target)).mkdir(parents=True)
    shutil.copy(os.path.join(site, target), tmp_path / target)
    (tmp_path / "change.diff").write_text(change)
    result = run_command(["patch", "-p1", "--dry-run", "-i", "change.diff"], cwd=tmp_path)
    assert result.returncode == 0 and "FAILED" not in result.stdout, result


def test_readme_s_state_table_gives_each_state_the_cli_s_exit_code():
    """README's table of states and exit codes says what ``cli.EXIT_CODES`` makes ``check`` and ``status`` return."""
    from deepspeed_offload_patch.cli import EXIT
    from deepspeed_offload_patch.states import State

    section = _readme_section("Python API and switches")
    rows = [line for line in section.splitlines() if line.startswith("| `") and line.rstrip().endswith("|")]
    stated = {}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        if cells[-1].isdigit():
            for state in re.findall(r"`([a-z-]+)`", cells[0]):
                stated[state] = int(cells[-1])
    documented = {state.value for state in State} - {State.OFF.value, State.NOT_NEEDED.value}
    assert set(stated) == documented, set(stated) ^ documented
    for state, code in stated.items():
        assert EXIT.get(State(state), 0 if state in ("applied", "upstream-fixed") else 1) == code, state


def test_ci_readme_s_phase_times_are_the_measured_ones():
    """ci/README.md holds the tables of the two timed runs as ``ci/ci_times.py`` renders them from the lines the runs
    wrote; each run starts with ci/test.sh, the idle run is under its 50 minutes, and the text says so where the
    loaded run is over CI's 90."""
    sys.path.insert(0, os.path.join(ROOT, "ci"))
    import ci_times
    idle, loaded = ci_times.read("ci-times.txt"), ci_times.read("ci-times-loaded.txt")
    assert idle and loaded and idle[0][2] == loaded[0][2] == "ci/test.sh", (idle, loaded)
    with open(os.path.join(ROOT, "ci", "README.md")) as f:
        section = _between(f.read(), "ci-times")
    assert ci_times.tables() in section, ci_times.tables()
    assert idle[-1][1] < 50 * 60, idle[-1]
    assert (loaded[-1][1] < 90 * 60) == ("over CI's 90 minutes" not in section), loaded[-1]
    # README's ci/test.sh figure is the idle run's.
    with open(os.path.join(ROOT, "README.md")) as f:
        found = re.search(
            r"`ci/test\.sh` about \d+ minutes \(measured on a fresh clone of \w+: (\d+) s with the setup", f.read())
    assert found and int(found.group(1)) == idle[0][0], (found and found.group(0), idle[0])


def test_the_oracle_table_is_the_recorded_runs():
    """docs/releases.md holds the oracle table as ``ci/oracle_table.py`` renders it from docs/oracle/*.json, and every
    recorded run shows the package right on every cell, patched; ZeRO-3 before 0.19.8 with every all-gather waited
    for (``testing/zero3_gather.py``), as the oracle trains it by default."""
    sys.path.insert(0, os.path.join(ROOT, "ci"))
    import oracle_table
    from packaging.version import Version

    from deepspeed_offload_patch.testing import zero3_gather
    runs = oracle_table.load()
    assert runs, "no oracle run is recorded under docs/oracle"
    with open(os.path.join(ROOT, "docs", "releases.md")) as f:
        assert oracle_table.table(runs) in _between(f.read(), "oracle")
    for release, run in runs.items():
        wrong = [cell["name"] for cell in run["cells"] if cell["patched"] != "right"]
        assert not wrong, (release, wrong)
        before_fix = Version(release) < Version(zero3_gather.FIXED_IN)
        assert run.get("zero3_gather_wait", False) == before_fix, (release, run.get("zero3_gather_wait"))


def test_the_outcome_table_is_the_recorded_runs():
    """docs/releases.md holds the one-inf table as ``ci/outcomes_table.py`` renders it from docs/outcomes/*.json, and
    every recorded run holds the core cells, each outcome one the harness names; the package's ``one_inf.json``, from
    which ``affected`` names a job's outcome, is the same runs, and stands each supported release for one recorded."""
    sys.path.insert(0, os.path.join(ROOT, "ci"))
    import oracle_table
    import outcomes_table

    from deepspeed_offload_patch.testing import outcomes
    runs = oracle_table.load(outcomes_table.RUNS)
    assert runs, "no outcome run is recorded under docs/outcomes"
    with open(os.path.join(ROOT, "docs", "releases.md")) as f:
        assert outcomes_table.table(runs) in _between(f.read(), "outcomes")
    core = {cell.name for cell in outcomes.core_cells()}
    for release, run in runs.items():
        assert core <= {row["name"] for row in run["cells"]}, release
        assert {row[side] for row in run["cells"] for side in ("unpatched", "patched")} <= set(outcomes.OUTCOMES)
    from packaging.specifiers import SpecifierSet

    from deepspeed_offload_patch import one_inf
    from deepspeed_offload_patch.releases import PATCHED_RELEASES
    with open(one_inf.DATA) as f:
        assert f.read() == outcomes_table.compact(runs), "run ci/outcomes_table.py"
    assert set(outcomes_table.STANDS_FOR) == set(runs)
    for version in PATCHED_RELEASES:
        standing = [r for r, releases in outcomes_table.STANDS_FOR.items() if SpecifierSet(releases).contains(version)]
        assert len(standing) == 1, (version, standing)


def test_the_accumulation_counts_are_the_measured_ones():
    """docs/performance.md's table is what the benchmark wrote at gradient accumulation 4 (docs/performance.json), on
    a release where both accumulation fixes apply; with the package's defaults the whole step's host syncs do not grow
    with N."""
    import json

    from deepspeed_offload_patch.bench_report import render_readme

    with open(os.path.join(ROOT, "docs", "performance.json")) as f:
        data = json.load(f)
    with open(os.path.join(ROOT, "docs", "performance.md")) as f:
        assert render_readme(data) in _between(f.read(), "bench")
    assert data["grad_accum"] == 4 and data["deepspeed"].strip() == "0.17.6", (data["grad_accum"], data["deepspeed"])
    for mode in {row["mode"] for row in data["results"]["patched+grad-norm"]}:
        counts = {row["whole_syncs"] for row in data["results"]["patched+grad-norm"] if row["mode"] == mode}
        assert len(counts) == 1, (mode, counts)
