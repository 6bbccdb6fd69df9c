"""`python -m onecall.lab [flags]`: the lab on its own, the same as `onecall lab [flags]` (one parser,
one error handling: onecall/cli.py's)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from onecall.cli import main as onecall_main

    return onecall_main(["lab", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
