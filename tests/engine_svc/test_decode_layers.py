"""Decode steps through the decoder layers in one C++ loop (`duoserve::decode_layers`,
engine_svc/models/decode_layers.py): on every decode step of a run the loop's hidden states
are the Python loop's bit for bit (both run on the step, the test compares), for each family
the loop serves, in float32 and bfloat16, one request and several, and through every
projection path; the families it does not describe keep the Python loop, and steps with
prompt tokens never take it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_svc import LLM, SamplingParams
from engine_svc.kernels import (
    bf16_pairs_available,
    cpu_kernels_available,
    onednn_linear_available,
)
from engine_svc.layers.linear import (
    LINEAR_PATH,
    MATMUL_PATH,
    ONEDNN_PATH,
    PACKED_PATH,
    PAIRS_PATH,
    PAIRS_SILU_PATH,
    Projection,
)
from engine_svc.models import fast_paths
from engine_svc.models.decode_layers import DecodeLayers
from engine_svc.models.llama import LlamaForCausalLM
from tests.engine_svc.family_configs import FAMILIES
from tests.model_fixtures import TOKENIZER_FILES


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_kernels_available(), "the CPU kernels did not build: see the warning logged"


SERVED = ["llama", "mistral", "qwen2", "phi3"]  # pre-norm layers, no q/k norms or caps
NOT_SERVED = ["gemma2", "gemma3", "qwen3", "granite", "olmo2", "mixtral", "qwen3_moe", "olmoe"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(FAMILIES[name]()).save_pretrained(folder)
            for file in TOKENIZER_FILES:
                if (default_model_dir / file).is_file():
                    shutil.copy(default_model_dir / file, folder / file)
            made[name] = folder
        return made[name]

    return make


def _model(llm: LLM) -> LlamaForCausalLM:
    model: LlamaForCausalLM = llm.engine_core.executor.runner.model
    return model


class BothLoops:
    """Wraps a model's forward: each step the C++ loop serves runs again through the Python
    loop, from the KV caches as they were before the step, and the two hidden states and
    the caches they leave must be equal. Before that, both run the step as a later pipeline
    stage would, from a given layer input and residual stream; the real step then writes its
    own K/V over what that one wrote."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.forward = model.forward
        self.steps: list[int] = []  # rows of each step compared
        self.other_steps = 0
        model.forward = self  # type: ignore[method-assign]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any,
                 meta: Any, intermediate: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        loop = self.model.decode_layers
        assert loop is not None
        if not loop.serves(meta, len(input_ids)):
            self.other_steps += 1
            return self.forward(input_ids, positions, kv_caches, meta, intermediate)
        staged = torch.stack(
            (self.model.embed(input_ids), torch.randn_like(self.model.embed(input_ids)))
        )
        assert torch.equal(*self._both(loop, input_ids, positions, kv_caches, meta, staged))
        fast, slow = self._both(loop, input_ids, positions, kv_caches, meta, intermediate)
        assert torch.equal(fast, slow), f"step of {len(input_ids)} rows differs"
        self.steps.append(len(input_ids))
        return fast

    def _both(self, loop: DecodeLayers, *inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        caches = [cache for pair in inputs[2] for cache in pair]
        before = [cache.clone() for cache in caches]
        fast = self.forward(*inputs)
        after_fast = [cache.clone() for cache in caches]
        for cache, saved in zip(caches, before, strict=True):
            cache.copy_(saved)
        self.model.decode_layers = None
        try:
            slow = self.forward(*inputs)
        finally:
            self.model.decode_layers = loop
        for cache, fast_cache in zip(caches, after_fast, strict=True):
            # as bytes: slots never written may hold NaN patterns, unequal to themselves
            assert torch.equal(cache.view(torch.uint8), fast_cache.view(torch.uint8)), (
                "the loops left different KV caches"
            )
        return fast, slow


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 5000, (n,), generator=generator).tolist() for n in (5, 40, 17)]


# Room for the three prompts and their tokens: BothLoops copies every cache three times a
# step, and a cache sized from the memory budget (8,192 blocks) made that most of the time.
KV_BLOCKS = 64
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _run(llm: LLM) -> BothLoops:
    both = BothLoops(_model(llm))
    prompts = _prompts()
    llm.generate(prompts[:1], PARAMS)  # one request: one-row steps
    llm.generate(prompts, PARAMS)  # several at once
    return both


@pytest.fixture
def llm_of(family_dirs: Any) -> Iterator[Any]:
    started: list[LLM] = []

    def start(name: str, dtype: str) -> LLM:
        llm = LLM(str(family_dirs(name)), dtype=dtype, num_kv_blocks=KV_BLOCKS)
        started.append(llm)
        return llm

    yield start
    for llm in started:
        llm.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", SERVED)
def test_decode_steps_equal_the_python_loop(llm_of: Any, name: str, dtype: str) -> None:
    llm = llm_of(name, dtype)
    assert _model(llm).decode_layers is not None
    both = _run(llm)
    assert 1 in both.steps and 3 in both.steps
    assert both.other_steps >= 2  # the prompts' steps ran the Python loop


@pytest.mark.parametrize("name", NOT_SERVED)
def test_other_layers_keep_the_python_loop(llm_of: Any, name: str) -> None:
    assert _model(llm_of(name, "float32")).decode_layers is None


# Each projection path, forced by what use_fused_ops is told this machine has.
PATHS = {
    "matmul": (torch.float32, {}, MATMUL_PATH, False),
    "packed": (torch.float32, {"packed_linear_available"}, PACKED_PATH, False),
    "linear+row": (torch.bfloat16, {"row_gemv_available"}, LINEAR_PATH, True),
    "packed-bf16": (
        torch.bfloat16,
        {"packed_linear_available"},
        PACKED_PATH,
        False,
    ),
    "onednn": (torch.bfloat16, {"onednn_linear_available"}, ONEDNN_PATH, False),
    "pairs": (torch.bfloat16, {"bf16_pairs_available"}, PAIRS_PATH, False),
    "onednn+row": (
        torch.bfloat16,
        {"onednn_linear_available", "one_row_copy_available"},
        ONEDNN_PATH,
        True,
    ),
}
AVAILABILITY = [
    "packed_linear_available",
    "bf16_pairs_available",
    "onednn_linear_available",
    "row_gemv_available",
    "one_row_copy_available",
]


@pytest.mark.parametrize("path", PATHS)
def test_each_projection_path(llm_of: Any, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    dtype, available, expected, rows = PATHS[path]
    if "onednn_linear_available" in available and not onednn_linear_available(dtype):
        pytest.skip("oneDNN's prepacked bfloat16 layout needs AMX or AVX512-BF16")
    if "bf16_pairs_available" in available and not bf16_pairs_available(dtype):
        pytest.skip("the bfloat16 pairs kernel needs AVX512-BF16 and a build with it")
    for name in AVAILABILITY:
        monkeypatch.setattr(fast_paths, name, lambda _dtype, on=name in available: on)
    llm = llm_of("qwen2", str(dtype).removeprefix("torch."))  # q/k/v with a bias
    loop = _model(llm).decode_layers
    assert loop is not None
    projections = [m for m in _model(llm).model.modules() if isinstance(m, Projection)]
    # On pairs, the MLPs' gate/up store silu(gate) * up (their halves are 128 columns).
    paths = {PAIRS_PATH, PAIRS_SILU_PATH} if expected == PAIRS_PATH else {expected}
    assert {p.kernel_args()[1][0] for p in projections} == paths
    assert all(p.row_gemv == rows for p in projections)
    # What a decode step reads sits in one region of huge pages; oneDNN's opaque layout stays
    # where it is, so on oneDNN alone (no one-row copy) nothing moves.
    read = [t for p in projections for t in fast_paths.decode_weights(p) if not t.is_mkldnn]
    assert bool(read) == (path != "onednn")
    assert len({t.untyped_storage().data_ptr() for t in read}) == min(len(read), 1)
    both = _run(llm)
    assert 1 in both.steps and 3 in both.steps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_enforce_eager_keeps_the_python_loop_and_the_tokens(
    family_dirs: Any, llm_of: Any, dtype: str
) -> None:
    """The whole generation, K/V writes included, gives the same tokens either way."""
    eager = LLM(str(family_dirs("qwen2")), dtype=dtype, enforce_eager=True, num_kv_blocks=KV_BLOCKS)
    try:
        model = _model(eager)
        assert model.fused_ops and model.decode_layers is None
        expected = [out.token_ids for out in eager.generate(_prompts(), PARAMS)]
    finally:
        eager.shutdown()
    llm = llm_of("qwen2", dtype)
    assert _model(llm).decode_layers is not None
    assert [out.token_ids for out in llm.generate(_prompts(), PARAMS)] == expected


def test_the_service_flag_sets_it() -> None:
    from engine_svc.__main__ import build_parser, engine_config

    parser = build_parser()
    assert engine_config(parser.parse_args(["--enforce-eager"]), "m").enforce_eager
    assert not engine_config(parser.parse_args([]), "m").enforce_eager
