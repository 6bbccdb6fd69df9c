"""`python -m onecall.lab [flags]`: the lab on its own, the same as `onecall lab [flags]`."""

from __future__ import annotations

import argparse
import sys

from onecall.errors import OnecallError
from onecall.lab.cli import add_lab_arguments, cmd_lab


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m onecall.lab", description="Reproduce the anatomy of one call."
    )
    add_lab_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_lab(args)
    except OnecallError as e:
        print(f"onecall lab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
