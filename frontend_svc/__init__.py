"""The frontend service: the stateless public API (frontend.v1.GenerationService). It owns
everything about text (tokenization, chat templates, incremental detokenization, stop
strings, n > 1) and spreads requests over engine services that speak token ids."""
