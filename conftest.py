# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The documents' examples, executed: every ``console`` transcript and every ``python`` example in README.md, docs/,
ci/README.md and tests/README.md runs in the suite (Sybil collects them; pytest.ini's testpaths name the files).

A ``console`` block is a transcript: ``$ command`` (a trailing ``\\`` continues it on the next line), then what the
command prints on stdout, up to the next ``$``. The command runs with bash in the checkout's root, with this Python's
scripts first on ``PATH`` and ``COLUMNS=119`` (argparse's width); ``$ export NAME=value`` sets a variable for the
block's later commands. Its stdout must match the shown text under doctest's ``ELLIPSIS`` (``...`` stands for any
text, several lines included), after this normalisation and nothing else:

- DeepSpeed's own log lines (``[YYYY-MM-DD hh:mm:ss,mmm] [LEVEL] ...``) are dropped from the output;
- ``Python X.Y.Z`` matches any Python version (the docs show where they were made; CI runs several);
- trailing spaces are dropped.

A command whose transcript shows no output must exit 0; one whose output is shown must exit 0 unless the transcript
prints its exit code itself (``; echo "exit $?"``). stderr is not compared; a failure shows it.

A ``text`` block that starts with ``$`` is a transcript too slow for this run (4 ranks or more); the text beside it
names the test module that runs it (docs/audit.md's pipeline audit: ``tests/pipeline``).

A ``python`` block runs in a fresh interpreter after the file's ``invisible-code-block: python`` comments (Sybil's
form for setup a reader need not see), so a failing example or an exception fails its test.
"""

import doctest
import os
import re
import subprocess
import sys
import tempfile
import time

import pytest

from deepspeed_offload_patch import cpu_shm

try:
    from sybil import Sybil
    from sybil.parsers.markdown import CodeBlockParser
except ImportError:  # the version matrix's virtualenvs run only tests/: they need not install the docs' runner
    Sybil = None
    CodeBlockParser = object

ROOT = os.path.dirname(os.path.abspath(__file__))
DEEPSPEED_LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\] \[[A-Z]+\] .*\n?", re.M)
PYTHON_VERSION = re.compile(r"\bPython \d+\.\d+\.\d+\b")


def _environment(extra: dict) -> dict:
    env = dict(os.environ, COLUMNS="119", **extra)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def normalise(text: str) -> str:
    """The documented normalisation of a transcript's text (the doc's and the command's alike)."""
    text = DEEPSPEED_LOG_LINE.sub("", text)
    text = PYTHON_VERSION.sub("Python X.Y.Z", text)
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def transcript(source: str) -> list:
    """``[(command, shown output or None)]`` of a console block."""
    steps, lines = [], source.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            raise ValueError(f"a console block must start each command with '$ ': {lines[i]!r}")
        command = lines[i][2:]
        while command.endswith("\\") and i + 1 < len(lines):
            i += 1
            command = command[:-1] + " " + lines[i].strip()
        i += 1
        shown = []
        while i < len(lines) and not lines[i].startswith("$ "):
            shown.append(lines[i])
            i += 1
        steps.append((command, "\n".join(shown) + "\n" if shown else None))
    return steps


#: How long the leak check waits for a new buffer file it did not expect to be removed: another job on the machine
#: (a second checkout's suite) may have just ended and be about to remove its own. ``SHM_LEAK_GRACE_S`` overrides it
#: (``test_cpu_shm`` runs a leaking test with 0, so that another suite beside it never waits on that file).
SHM_GRACE_S = float(os.environ.get("SHM_LEAK_GRACE_S", "10"))


@pytest.fixture(autouse=True)
def leaves_no_deepspeed_shm_files(request):
    """Every test (each job it launches) must leave ``/dev/shm`` with DeepSpeed's buffer files as it found them
    (69 MB of RAM per rank that DeepSpeed never removes). A file that appeared during the test, that no live process
    uses, and that is still there after :data:`SHM_GRACE_S` fails the test, and is removed."""
    before = cpu_shm.buffer_files()
    yield
    left = cpu_shm.leftovers(before)
    deadline = time.monotonic() + SHM_GRACE_S
    while left and time.monotonic() < deadline:
        time.sleep(1.0)
        left = [path for path in cpu_shm.leftovers(before) if path in left]
    if left:
        cpu_shm.remove(left)
        pytest.fail(f"{request.node.nodeid} left {len(left)} DeepSpeed shm buffer file(s) in {cpu_shm.SHM_DIR} "
                    f"(removed now): {', '.join(os.path.basename(p) for p in left)}")


class ConsoleTranscript(CodeBlockParser):
    language = "console"

    def evaluate(self, example) -> None:
        exported = {}
        for command, shown in transcript(example.parsed):
            assignment = re.fullmatch(r"export (\w+)=(\S*)", command.strip())
            if assignment:
                exported[assignment.group(1)] = assignment.group(2)
                continue
            done = subprocess.run(["bash", "-c", command],
                                  cwd=ROOT,
                                  env=_environment(exported),
                                  capture_output=True,
                                  text=True)
            where = f"$ {command}\n(exit {done.returncode}; stderr:\n{done.stderr[-3000:]})"
            if shown is None or "echo \"exit $?\"" not in command:
                assert done.returncode == 0, f"the command failed: {where}"
            if shown is None:
                continue
            want, got = normalise(shown), normalise(done.stdout)
            checker = doctest.OutputChecker()
            if not checker.check_output(want, got, doctest.ELLIPSIS):
                raise AssertionError(f"the transcript differs from what the command prints: {where}\n" +
                                     checker.output_difference(doctest.Example(command, want), got, doctest.ELLIPSIS))


class PythonExample(CodeBlockParser):
    """Each visible block runs in its own interpreter, after the document's invisible setup blocks so far."""
    language = "python"

    def evaluate(self, example) -> None:
        setup = example.namespace.setdefault("_invisible_setup", [])
        if example.region.lexemes.get("directive", "").startswith("invisible"):
            setup.append(example.parsed)
            return
        with tempfile.TemporaryDirectory() as work:
            script = os.path.join(work, "example.py")
            with open(script, "w") as f:
                f.write("\n".join(setup + [example.parsed]))
            done = subprocess.run([sys.executable, script],
                                  cwd=ROOT,
                                  env=_environment({}),
                                  capture_output=True,
                                  text=True)
        assert done.returncode == 0, f"the example failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"


if Sybil is not None:
    pytest_collect_file = Sybil(parsers=[ConsoleTranscript(), PythonExample()],
                                patterns=["README.md", "*.md"],
                                excludes=["CHANGELOG.md", "patches/*", "build/*", ".nox/*", ".venv/*"]).pytest()
else:

    class _NeedsSybil(pytest.File):
        """A document collected without Sybil: collecting it (only when it is asked for) fails loudly instead of
        letting it pass unrun."""

        def collect(self):
            raise ImportError(f"{self.path.name}'s examples run with Sybil: pip install sybil (in the dev extra)")

    def pytest_collect_file(file_path, parent):
        if file_path.suffix == ".md":
            return _NeedsSybil.from_parent(parent, path=file_path)
