"""Tests of GGUF and safetensors reading, hostile files (fuzzed)."""
