"""Logits -> token ids: the batched sampler, penalties, and grammar constraints (llguidance) as bitmasks."""
