"""Compiles grammars against the model's vocabulary on a background thread, once each.

The busy loop never waits for a compile: a request whose grammar is not ready stays in the
waiting queue while the others run. The tokenizer is loaded on the first constrained
request, on the same thread.

Compiled grammars are kept for the requests that repeat a constraint, up to a bound in
bytes (xgrammar's own measure of each), the least recently asked for dropped first: clients
that each send a schema of their own would otherwise grow the engine without end. A grammar
dropped from the cache lives on with the requests that use it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine_svc.config import GRAMMAR_CACHE_BYTES
from engine_svc.sampling_params import SamplingParams
from engine_svc.structured.grammars import grammar_of

# For SmolLM2's 49,152-token vocabulary a short regex's grammar measured 16-42 KB, a
# one-property JSON schema's 30 KB: the default bound holds thousands.

_Key = tuple[str, str]


class GrammarCompiler:
    def __init__(
        self,
        tokenizer_dir: str,
        vocab_size: int,
        stop_token_ids: list[int],
        cache_bytes: int = GRAMMAR_CACHE_BYTES,
    ) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.cache_bytes = cache_bytes
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compiler")
        # Least recently asked for first; compiles in flight count once they are done.
        self._cache: OrderedDict[_Key, Future[Any]] = OrderedDict()
        self._sizes: dict[_Key, int] = {}  # the compiled ones' bytes
        self.cached_bytes = 0
        self._lock = threading.Lock()
        self._compiler: Any = None

    def compile(self, params: SamplingParams) -> Future[Any]:
        """A future CompiledGrammar for the request's constraint; shared by equal constraints."""
        key = params.constraint
        assert key is not None
        with self._lock:
            future = self._cache.get(key)
            is_new = future is None
            if future is None:
                future = self._pool.submit(self._compile, params)
                self._cache[key] = future
            self._cache.move_to_end(key)
        if is_new:  # outside the lock: a future already done calls back at once
            future.add_done_callback(lambda done: self._settle(key, done))
        return future

    def _settle(self, key: _Key, future: Future[Any]) -> None:
        """A compile ended: a failure leaves the cache (the next request tries again), a
        grammar is counted, and the oldest grammars go until the cache is within its bound."""
        with self._lock:
            if self._cache.get(key) is not future:
                return
            if future.cancelled() or future.exception() is not None:
                del self._cache[key]
                return
            size = int(future.result().memory_size_bytes)
            self._sizes[key] = size
            self.cached_bytes += size
            for old in list(self._cache):
                if self.cached_bytes <= self.cache_bytes:
                    break
                if old in self._sizes:  # compiles still in flight stay
                    self.cached_bytes -= self._sizes.pop(old)
                    del self._cache[old]

    @property
    def num_grammars(self) -> int:
        """Grammars cached or compiling."""
        with self._lock:
            return len(self._cache)

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
            # The cache above is the only one: xgrammar's own is unbounded by default.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
