"""Structured output: grammars compiled with xgrammar, token bitmasks applied before sampling."""
