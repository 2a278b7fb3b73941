"""Compiles grammars against the model's vocabulary on a background thread, once each.

The busy loop never waits for a compile: a request whose grammar is not ready stays in the
waiting queue while the others run. The tokenizer is loaded on the first constrained
request, on the same thread.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine_svc.sampling_params import SamplingParams
from engine_svc.structured.grammars import grammar_of


class GrammarCompiler:
    def __init__(self, tokenizer_dir: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compiler")
        self._cache: dict[tuple[str, str], Future[Any]] = {}
        self._lock = threading.Lock()
        self._compiler: Any = None

    def compile(self, params: SamplingParams) -> Future[Any]:
        """A future CompiledGrammar for the request's constraint; shared by equal constraints."""
        key = params.constraint
        assert key is not None
        with self._lock:
            future = self._cache.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._pool.submit(self._compile, params)
                self._cache[key] = future
        return future

    def _compile(self, params: SamplingParams) -> Any:
        compiler = self._get_compiler()
        return compiler.compile_grammar(grammar_of(params))

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
