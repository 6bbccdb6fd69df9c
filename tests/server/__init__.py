"""Tests of the server's parts in process: protocol, the engine thread, the supervisor, KV events."""
