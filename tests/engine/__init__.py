"""Tests of the engine: scheduling, the KV books, faults, request isolation, static steps, tensor parallel."""
