"""Tests of a real `onecall serve` subprocess, the official clients, a real browser."""
