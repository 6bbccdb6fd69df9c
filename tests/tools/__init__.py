"""Tests of tool calling: parsing, specs, LLM.chat with tools."""
