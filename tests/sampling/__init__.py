"""Tests of the sampler, penalties, grammar masks, provenance."""
