# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""``ds-offload-patch`` (also ``python -m deepspeed_offload_patch``): status, CI gate, behavioural check, diff, launcher,
host-sync audit of a user's run.

Each command is a parser function beside its handler; each command's exit codes are stated once, in :data:`EXITS`
(``check`` and ``status``: the table :data:`EXIT_CODES`), and its ``--help``, the parser's epilog and the list at the
end of this text are made from them. The changes are read from :mod:`deepspeed_offload_patch.changes`.
"""

import argparse
import json
import platform
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

from deepspeed_offload_patch import settings
from deepspeed_offload_patch.changes import OTHERS, UPSTREAM
from deepspeed_offload_patch.changes.record import Change
from deepspeed_offload_patch.states import GOOD_STATES, State


@dataclass(frozen=True)
class ExitCode:
    """One exit code of ``check`` and ``status``: what it means, and the states that give it."""

    code: int
    meaning: str
    states: Tuple[State, ...] = ()

    def text(self) -> str:
        """``3 conflict: another patch ...``: the code, its states, its meaning."""
        states = f" {', '.join(self.states)}:" if self.states else ""
        return f"{self.code}{states} {self.meaning}"


#: The exit codes of ``check`` and ``status`` (the same for both; ``status`` prints the state whatever it is). The fix's
#: state decides; when it exits 0, the first default-on change that is on and not in effect decides with its own state.
EXIT_CODES = (
    ExitCode(
        0, f"the fix is active, and {' and '.join(change.title for change in OTHERS)} are each in effect, not needed "
        "or switched off", GOOD_STATES),
    ExitCode(
        1,
        f"the fix, or a change on by default, is not active (unknown release or code; not-applied: {settings.AUTO}=0)",
        (State.UNSUPPORTED, State.NOT_APPLIED, State.PENDING, State.REVERTED)),
    ExitCode(2, "usage error"),
    ExitCode(3, "another patch replaced one of the methods", (State.CONFLICT, )),
    ExitCode(4, "DeepSpeed is not installed", (State.DEEPSPEED_MISSING, )),
    ExitCode(5, f"switched off by {settings.DISABLE}", (State.DISABLED, )),
)

#: The exit code of each state (a state not listed exits 1).
EXIT = {state: row.code for row in EXIT_CODES for state in row.states}

#: The exit codes of ``check`` and ``status``, as their ``--help`` says them.
EXIT_TEXT = "; ".join(row.text() for row in EXIT_CODES)

#: Each command's exit codes, in words: the one place they are stated.
EXITS = {
    "status":
    EXIT_TEXT,
    "check":
    EXIT_TEXT,
    "verify":
    "0 pass, 1 fail",
    "diff":
    "0, or 1 when there is no diff for this DeepSpeed",
    "affected":
    "0 when no defect stays (none, or each fixed by default here; an opt-in change's does not count), 1 when one "
    "does or may, 2 when the config cannot be read",
    "run":
    "the command's own code; 2 no command; 127 the command cannot be started",
    "audit":
    "the command's code if it fails, 1 if a budget is exceeded or no optimizer step was counted, 2 no "
    "command, 127 the command cannot be started, else 0",
}

__doc__ += "\nExit codes of ``check`` and ``status``:\n\n" + "".join(f"* {row.text()}\n" for row in EXIT_CODES)
__doc__ += "\nThe other commands':\n\n" + "".join(
    f"* ``{command}``: {text}\n" for command, text in EXITS.items() if command not in ("check", "status"))

ADVICE = {
    State.UNSUPPORTED: "pin a supported DeepSpeed release or upgrade deepspeed_offload_patch "
    "(`ds-offload-patch status` shows what the guard found)",
    State.CONFLICT: "find the other patch that replaces these methods and drop one of the two",
    State.DEEPSPEED_MISSING: "install DeepSpeed in this environment (torch first)",
    State.DISABLED: f"unset {settings.DISABLE}",
}


def resolve_status():
    """Import the package and, where DeepSpeed is installed, its ZeRO module, so the state is final (not pending).

    Strict mode's error, or DeepSpeed's module failing to import, is reported as the status it leaves (the reason
    names the exception), not raised. DeepSpeed's import logs to stdout; that
    goes to stderr here, so that stdout holds only this command's output (``status --json`` parses).
    """
    import contextlib
    import importlib

    import deepspeed_offload_patch as dop
    from deepspeed_offload_patch import patcher

    if dop.status().state == State.PENDING:
        with contextlib.redirect_stdout(sys.stderr):
            try:
                importlib.import_module(patcher.TARGET_MODULE)
            except Exception as exc:
                # DeepSpeed itself can fail to import before its ZeRO module is reached (0.14.0 with a torch it
                # predates), so the import hook never hears of it: report it the same way.
                if dop.status().state == State.PENDING:
                    patcher._on_target_import_error(exc)
    return dop.status()


def _status_parser(sub) -> None:
    status = sub.add_parser("status",
                            help="what the patch does with the installed DeepSpeed (exit code as check's)",
                            description="Print the installed DeepSpeed's version, the patch state, the reason and "
                            f"the finding per method. Exit: {EXITS['status']}.")
    status.add_argument("--json", action="store_true", help="machine-readable output (stable keys)")
    status.set_defaults(func=_status_command)


def _status_command(args) -> int:
    import deepspeed_offload_patch as dop

    status = resolve_status()
    if args.json:
        print(
            json.dumps({
                "package_version": dop.__version__,
                "python": platform.python_version(),
                **status.as_dict()
            },
                       indent=2,
                       sort_keys=True))
        return status_exit_code(status)

    def methods(change) -> None:
        # Findings by key (bare on ZeRO-1/2's class, else Class.name); none for a change left out (they'd be another's)
        if not change.upstream and status.of(change)[0] in (State.OFF, State.DISABLED):
            return
        keys = {change.key(name): name for name in change.method_names}
        for key, finding in status.methods.items():
            if key in keys and (change.upstream or not any(key in other_keys for other_keys in upstream_keys)):
                print(f"  {change.target.name}.{keys[key]}: {finding}")

    upstream_keys = [{UPSTREAM.key(name) for name in UPSTREAM.method_names}]
    print(f"deepspeed_offload_patch {dop.__version__} on Python {platform.python_version()}")
    print(f"DeepSpeed {status.deepspeed_version or '(not installed)'}: {status.state} ({UPSTREAM.label})")
    print(f"  {status.reason}")
    methods(UPSTREAM)
    for change in OTHERS:
        state, reason = status.of(change)
        print(f"{change.label}: {state}{': ' + reason if reason else ''}")
        methods(change)
    return status_exit_code(status)


def exit_code(state: State) -> int:
    """The exit code of the upstream change's ``state`` alone (:data:`EXIT_CODES`; 0 for a good state, 1 for a state
    not listed)."""
    return EXIT.get(state, 1)


def status_exit_code(status) -> int:
    """The exit code of ``check`` and ``status``: the upstream change's, else that of the first other change that is
    on and not in effect (unsupported, conflict, reverted): every change the installed DeepSpeed needs."""
    code = exit_code(status.state)
    if code == 0:
        change = failing_change(status)
        if change is not None:
            code = EXIT.get(status.of(change)[0], 1)
    return code


def failing_change(status) -> Optional[Change]:
    """The first change beside the upstream one whose state is not one of its good states, or None."""
    return next((change for change in OTHERS if status.of(change)[0] not in change.good_states), None)


def _check_parser(sub) -> None:
    sub.add_parser("check",
                   help="CI gate: exit 0 only if the installed DeepSpeed gets the fix",
                   description=f"One line. Exit: {EXITS['check']}.").set_defaults(func=_check_command)


def _check_command(args) -> int:
    status = resolve_status()
    code = status_exit_code(status)
    version = status.deepspeed_version or "(not installed)"
    # The interpreter is part of the answer: the same DeepSpeed can be patched on one Python and not on another.
    python = f"Python {platform.python_version()}"
    if code == 0:
        opt_in = {c.name: " (opt-in)" for c in OTHERS if settings.off_as_by_default(c)}
        others = ", ".join(f"{c.title} {status.of(c)[0]}{opt_in.get(c.name, '')}" for c in OTHERS)
        print(f"ds-offload-patch check: OK: DeepSpeed {version} is {status.state}, {others} ({python})")
    elif exit_code(status.state):
        print(f"ds-offload-patch check: FAIL ({status.state}, {python}): {status.reason}; "
              f"{ADVICE.get(status.state, 'see ds-offload-patch status')}")
    else:
        change = failing_change(status)
        state, reason = status.of(change)
        print(f"ds-offload-patch check: FAIL ({change.title} {state}, {python}): {reason}; "
              f"{ADVICE.get(state, 'see ds-offload-patch status')} (or {change.switch}=0 to go without it)")
    return code


def _verify_parser(sub) -> None:
    verify = sub.add_parser("verify",
                            help="train a tiny ZeRO-2 offload engine and prove there is no host sync",
                            description="Train a tiny ZeRO-2 offload engine on one rank (CPU, or the GPU DeepSpeed "
                            "finds) with no device value read in a boundary backward (no_host_sync of reads), then "
                            f"show that a NaN gradient still skips the step. Exit: {EXITS['verify']}.")
    verify.add_argument("--steps",
                        type=_positive,
                        default=3,
                        metavar="N",
                        help="optimizer steps under the host-sync guard (default 3)")
    verify.set_defaults(func=_verify_command)


def _verify_command(args) -> int:
    from deepspeed_offload_patch.verify import verify
    return verify(steps=args.steps)


def _diff_parser(sub) -> None:
    diff = sub.add_parser("diff",
                          help="print the unified diff of the same change for the installed release",
                          description="Print the unified diff from patches/ for the installed DeepSpeed (past the "
                          "last release tested: the diff of the last release whose methods it has); its file name "
                          "goes to stderr. Apply it with patch -p1 in site-packages. Exit: "
                          f"{EXITS['diff']}.")
    which = diff.add_mutually_exclusive_group()
    for change in OTHERS:
        which.add_argument(f"--{change.name}",
                           action="store_const",
                           dest="part",
                           const=change.name,
                           help=change.diff_help)
    diff.set_defaults(func=_diff_command, part=UPSTREAM.name)


def _diff_command(args) -> int:
    from deepspeed_offload_patch.diffs import diff_for_installed
    try:
        name, text = diff_for_installed(args.part)
    except LookupError as exc:
        print(f"ds-offload-patch diff: {exc}", file=sys.stderr)
        return 1
    print(f"# {name}", file=sys.stderr)
    sys.stdout.write(text)
    return 0


def _affected_parser(sub) -> None:
    defects = ", ".join(change.defect[1] for change in (UPSTREAM, ) + OTHERS)
    affected = sub.add_parser("affected",
                              help="which defects a DeepSpeed config's job has, and whether this package fixes each",
                              description="Read a DeepSpeed config (the JSON given to the deepspeed launcher, HF "
                              "Trainer or Accelerate) and say, with the installed DeepSpeed, whether the job has each "
                              f"defect ({defects}), whether the package fixes each, and its host waits per tensor on "
                              f"a GPU with what removes each. \"auto\" gives \"maybe\". Exit: {EXITS['affected']}.")
    affected.add_argument("config", help="the DeepSpeed config JSON file")
    affected.add_argument("--json", action="store_true", help="machine-readable output")
    affected.set_defaults(func=_affected_command)


def _affected_command(args) -> int:
    from deepspeed_offload_patch.affected import report
    return report(args.config, resolve_status, as_json=args.json)


def _command_after_dashes(args, name: str) -> Optional[List[str]]:
    """The command after ``--``; None (with a message) when there is none."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print(f"ds-offload-patch {name}: give a command after --", file=sys.stderr)
        return None
    return command


def _run_parser(sub) -> None:
    run = sub.add_parser("run",
                         help="run a command with the patch applied in every Python process it starts",
                         description="Run COMMAND with a bootstrap sitecustomize first on PYTHONPATH, so every "
                         "Python process it starts (the ranks of deepspeed, torchrun, accelerate launch) imports the "
                         f"patch. Exit: {EXITS['run']}.")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    run.set_defaults(func=_run_command)


def _run_command(args) -> int:
    from deepspeed_offload_patch.launcher import run
    command = _command_after_dashes(args, "run")
    return 2 if command is None else run(command)


def _audit_parser(sub) -> None:
    audit = sub.add_parser("audit",
                           help="count host syncs per training phase in the ranks of a command, with budgets",
                           description="Run COMMAND as `run` does and count, in every rank, the host syncs of the "
                           "engine's forward, boundary backward, other backward and step() (and their sum, the whole "
                           f"step) for the first optimizer steps. Exit: {EXITS['audit']}.")
    audit.add_argument("--steps", type=_positive, default=3, metavar="N", help="optimizer steps to count (default 3)")
    audit.add_argument("--stop-after",
                       action="store_true",
                       help="end the run (exit 0) after the counted steps, for CI smoke runs")
    audit.add_argument("--json", metavar="FILE", help="write every rank's numbers to FILE")
    audit.add_argument("--max-backward-syncs",
                       type=_budget,
                       nargs="?",
                       const=0,
                       metavar="K",
                       help="fail if a rank's boundary or other backward makes more than K host syncs in an optimizer "
                       "step (K defaults to 0)")
    audit.add_argument("--max-step-syncs",
                       type=_budget,
                       metavar="K",
                       help="fail if a rank's step() calls make more than K host syncs in an optimizer step")
    audit.add_argument("--max-total-syncs",
                       type=_budget,
                       metavar="K",
                       help="fail if a rank makes more than K host syncs in a whole optimizer step (every "
                       "micro-step's forward and backward, then step())")
    audit.add_argument("--compare",
                       action="store_true",
                       help="run the command twice, patch disabled then applied, and print both (budgets apply to "
                       "the patched run)")
    audit.add_argument("--top",
                       type=_positive,
                       default=3,
                       metavar="N",
                       help="source lines shown per phase (default 3)")
    audit.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    audit.set_defaults(func=_audit_command)


def _audit_command(args) -> int:
    from deepspeed_offload_patch.audit.command import audit
    command = _command_after_dashes(args, "audit")
    if command is None:
        return 2
    budgets = {
        "max_backward_syncs": args.max_backward_syncs,
        "max_step_syncs": args.max_step_syncs,
        "max_total_syncs": args.max_total_syncs
    }
    return audit(command,
                 steps=args.steps,
                 stop_after=args.stop_after,
                 json_path=args.json,
                 budgets=budgets,
                 compare=args.compare,
                 top=args.top)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def _budget(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


#: The commands, in the order ``--help`` lists them: each adds its parser (and handler) to the subparsers.
COMMANDS = (_status_parser, _check_parser, _verify_parser, _diff_parser, _affected_parser, _run_parser, _audit_parser)


def build_parser() -> argparse.ArgumentParser:
    """The ``ds-offload-patch`` argument parser (each subcommand sets ``func``)."""
    exits = f"Exit codes of check and status: {EXIT_TEXT}. " + ". ".join(
        f"{command}: {text}" for command, text in EXITS.items() if command not in ("check", "status")) + "."
    parser = argparse.ArgumentParser(prog="ds-offload-patch",
                                     description="DeepSpeed ZeRO-1/2 offload overflow flag patch: status, CI gate, "
                                     "behavioural check, diff, launcher and host-sync audit.",
                                     epilog=exits)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
