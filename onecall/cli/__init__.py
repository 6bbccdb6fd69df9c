"""The `onecall` command: run one call and show its anatomy, chat, serve, replay, the lab.

    onecall run "What is the capital of France?" --trace     # answer + the trace table     cli/generate.py
    onecall run "..." --json                                  # answer + trace as JSON
    onecall run "..." --save-bundle call.json                 # + a replayable bundle
    onecall chat                                              # multi-turn, cached tokens   cli/generate.py
    onecall replay call.json                                  # re-run it: did every token  cli/replay.py
                                                              # match?
    onecall serve --port 8000                                 # the OpenAI-compatible API   cli/serve.py
    onecall lab --out lab-report                              # every experiment, a report  lab/cli.py

Each command's module adds its own subparser; the engine flags every command takes (--model,
--dtype, ...), the lab's included, live in onecall/engine_flags.py. Errors a user can cause print
one clear line and exit 2; no stack trace.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from onecall.cli.generate import add_chat_command, add_run_command
from onecall.cli.replay import add_replay_command
from onecall.cli.serve import add_serve_command
from onecall.errors import OnecallError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onecall", description="Serve a model and see what one call really does."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_command(sub)
    add_replay_command(sub)
    add_chat_command(sub)
    add_serve_command(sub)
    _add_lab_command(sub)
    return parser


def _add_lab_command(sub: Any) -> None:
    """`onecall lab`: its flags and command live in onecall/lab/cli.py (imported here, so it keeps
    its own heavy imports inside cmd_lab); the subcommand is left out while that module is missing."""
    try:
        from onecall.lab.cli import add_lab_arguments, cmd_lab
    except ModuleNotFoundError as e:
        if e.name in ("onecall.lab", "onecall.lab.cli"):
            return
        raise
    p_lab = sub.add_parser("lab", help="reproduce the anatomy of one call on this model: a report with plots")
    add_lab_arguments(p_lab)
    p_lab.set_defaults(func=cmd_lab)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except OnecallError as e:
        print(f"onecall: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
