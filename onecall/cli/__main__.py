"""`python -m onecall.cli ...`: the `onecall` command (what the tests' server subprocesses run)."""

import sys

from onecall.cli import main

sys.exit(main())
