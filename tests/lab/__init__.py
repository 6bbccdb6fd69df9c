"""Tests of `onecall lab` and its experiments."""
