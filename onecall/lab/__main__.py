"""`python -m onecall.lab [flags]`: the lab on its own, the same as `onecall lab [flags]`: the same
flags (lab/cli.py), the same usage line, and errors a user can cause end the same way (one line,
exit 2). It does not import onecall/cli/: the CLI imports the lab, never the other way round."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from onecall import OnecallError
    from onecall.lab.cli import add_lab_arguments, cmd_lab

    parser = argparse.ArgumentParser(prog="onecall lab")
    add_lab_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_lab(args)
    except OnecallError as e:
        print(f"onecall: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
