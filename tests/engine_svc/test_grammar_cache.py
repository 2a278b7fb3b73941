"""The compiled-grammar cache (engine_svc/structured/compiler.py) stays within its bound in
bytes, drops the least recently asked for grammar first, recompiles a dropped one when it is
asked for again, and forgets failed compiles, so a stream of distinct constraints (a schema
per client) cannot grow the engine without end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_svc import LLM
from engine_svc.config import GRAMMAR_CACHE_BYTES
from engine_svc.sampling_params import SamplingParams
from engine_svc.structured.compiler import GrammarCompiler
from shared.errors import InvalidRequestError


def _regex(i: int) -> SamplingParams:
    """Distinct constraints whose grammars are all of one size."""
    return SamplingParams(regex=f"[a-z]{{4}}-{i:03d}")


def _settled(compiler: GrammarCompiler) -> None:
    """Every compile submitted so far has ended and been counted: the one compile thread
    runs a compile's callbacks before it takes the next task."""
    compiler._pool.submit(lambda: None).result(timeout=60)


@pytest.fixture
def open_compiler(tiny_model_dir: Path) -> Iterator[GrammarCompiler]:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    compiler = GrammarCompiler(str(tiny_model_dir), config["vocab_size"], [config["eos_token_id"]])
    yield compiler
    compiler.shutdown()


def test_the_cache_keeps_within_its_bound_dropping_the_oldest(
    open_compiler: GrammarCompiler,
) -> None:
    compiler = open_compiler
    one = compiler.compile(_regex(0)).result(timeout=60)
    _settled(compiler)
    size = one.memory_size_bytes
    assert size > 0 and compiler.cached_bytes == size
    compiler.cache_bytes = 3 * size + size // 2  # room for three grammars of this size

    futures = [compiler.compile(_regex(i)) for i in range(1, 8)]
    for future in futures:
        future.result(timeout=60)
    _settled(compiler)
    assert compiler.cached_bytes <= compiler.cache_bytes
    assert compiler.num_grammars == 3
    # The newest is kept (asked for again, the same compile), the first went long ago.
    assert compiler.compile(_regex(7)) is futures[-1]
    again = compiler.compile(_regex(0))
    assert again.result(timeout=60).memory_size_bytes == size  # compiled anew, and usable
    _settled(compiler)
    assert compiler.cached_bytes <= compiler.cache_bytes


def test_asking_again_keeps_a_grammar_from_being_dropped(open_compiler: GrammarCompiler) -> None:
    compiler = open_compiler
    first = compiler.compile(_regex(0))
    size = first.result(timeout=60).memory_size_bytes
    compiler.cache_bytes = 2 * size + size // 2  # two grammars
    compiler.compile(_regex(1)).result(timeout=60)
    assert compiler.compile(_regex(0)) is first  # now the most recently asked for
    compiler.compile(_regex(2)).result(timeout=60)  # drops regex 1, not regex 0
    _settled(compiler)
    assert compiler.compile(_regex(0)) is first
    assert compiler.num_grammars == 2


def test_a_failed_compile_leaves_the_cache(open_compiler: GrammarCompiler) -> None:
    compiler = open_compiler
    failed = compiler.compile(SamplingParams(regex="[0-9"))  # admission would refuse it
    with pytest.raises(Exception):  # noqa: B017 - xgrammar's own error type
        failed.result(timeout=60)
    _settled(compiler)
    assert compiler.num_grammars == 0 and compiler.cached_bytes == 0
    assert compiler.compile(SamplingParams(regex="[0-9")) is not failed  # tried again


def test_the_bound_is_an_engine_option_and_a_service_flag(tiny_model_dir: Path) -> None:
    from engine_svc.__main__ import build_parser, engine_config

    llm = LLM(str(tiny_model_dir), max_model_len=256, grammar_cache_bytes=12345)
    assert llm.engine_core.structured_output.compiler.cache_bytes == 12345
    parser = build_parser()
    assert engine_config(parser.parse_args([]), "m").grammar_cache_bytes == GRAMMAR_CACHE_BYTES
    flagged = parser.parse_args(["--grammar-cache-mib", "1.5"])
    assert engine_config(flagged, "m").grammar_cache_bytes == 3 << 19
    with pytest.raises(InvalidRequestError) as refused:
        engine_config(parser.parse_args(["--grammar-cache-mib", "-1"]), "m")
    assert refused.value.field == "grammar_cache_mib"  # reported as --grammar-cache-mib
