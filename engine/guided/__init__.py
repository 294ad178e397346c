"""Structured output: grammar guides compiled by xgrammar (``grammar``) and an engine's
guided requests with the logits mask of each of their rows (``requests``)."""
