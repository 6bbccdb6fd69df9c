"""Tests of onecall/loading/: checkpoint tensors into a runnable model (the pack cache)."""
