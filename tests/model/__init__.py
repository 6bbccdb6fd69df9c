"""Tests of the network against transformers (float32, tolerances written down), configs, RoPE, tensor parallel."""
