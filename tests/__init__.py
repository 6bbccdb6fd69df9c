"""onecall test suite."""
