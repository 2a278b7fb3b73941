"""Each model family the engine serves, as a tiny random model built from the family's own
transformers config class and saved with `save_pretrained`: greedy tokens equal transformers
`generate` on 16 prompts, all requests at once, with chunked prefill forced, with prefix-cache
hits (a second round of the same prompts), with preemption forced, and without the C++
kernels; logprobs within 1e-3 of transformers' log-softmax. A sliding-window model's prompts
run past its window, and its KV use stops growing at the window. `make bench MODEL=DIR` runs
on a family's model."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine_svc import LLM, SamplingParams
from engine_svc.core.kv_cache.sizing import blocks_per_request
from engine_svc.distributed.layout import ParallelLayout
from engine_svc.messages import EngineCoreRequest
from engine_svc.models.model_spec import load_model_spec
from engine_svc.models.sharding import check_divisible
from shared.errors import InvalidRequestError
from tests.engine_svc.engine_helpers import assert_kv_cache_clean
from tests.engine_svc.hf_reference import hf_greedy, hf_token_logprobs, load_hf_model
from tests.model_fixtures import TOKENIZER_FILES

REPO_ROOT = Path(__file__).resolve().parents[2]
VOCAB_SIZE = 49152  # the default model's tokenizer, which the engine loads with the model
NUM_PROMPTS = 16
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    # Wide weights make the random model's logits peaky: near-ties between the top two tokens
    # would turn float rounding into spurious mismatches.
    "initializer_range": 0.25,
}


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**COMMON, tie_word_embeddings=True)


def _llama3_rope() -> Any:
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            "rope_theta": 500000.0}  # fmt: skip
    return LlamaConfig(**COMMON, tie_word_embeddings=False, rope_parameters=rope)


def _yarn_rope() -> Any:
    from transformers import LlamaConfig

    # Longer sequences than the original context: yarn is the same at every length.
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
            "rope_theta": 10000.0}  # fmt: skip
    return LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters=rope)


def _dynamic_rope() -> Any:
    from transformers import LlamaConfig

    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    return LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters=rope)


WINDOW = 32  # shorter than most prompts here


def _mistral() -> Any:
    from transformers import MistralConfig

    return MistralConfig(**COMMON, sliding_window=WINDOW)


def _gemma2() -> Any:
    from transformers import Gemma2Config

    # Layer 0 windowed, layer 1 global; caps low enough that tanh bends the random model's
    # scores and logits.
    return Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                        attn_logit_softcapping=5.0, final_logit_softcapping=20.0)  # fmt: skip


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    # Windowed, global, windowed; the global layer's rotary scaled (linear), the windowed
    # ones on their own base; q/k norms.
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
    }
    layers = ["sliding_attention", "full_attention", "sliding_attention"]
    config = {**COMMON, "num_hidden_layers": 3}
    return Gemma3TextConfig(**config, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                            layer_types=layers, rope_parameters=rope)  # fmt: skip


def _qwen2() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**COMMON, tie_word_embeddings=True)  # q, k and v carry a bias


def _qwen3() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True)  # q/k RMSNorm


def _phi3() -> Any:
    from transformers import Phi3Config

    return Phi3Config(**COMMON)  # qkv_proj and gate_up_proj in the checkpoint


def _phi3_longrope() -> Any:
    from transformers import Phi3Config

    # Sequences within the original context (short factors), a scaled cos and sin.
    half = COMMON["hidden_size"] // COMMON["num_attention_heads"] // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.25 * i for i in range(half)],
            "long_factor": [2.0 + i for i in range(half)],
            "original_max_position_embeddings": 256}  # fmt: skip
    return Phi3Config(**COMMON, rope_parameters=rope, original_max_position_embeddings=256)


def _granite() -> Any:
    from transformers import GraniteConfig

    return GraniteConfig(**COMMON, embedding_multiplier=2.0, residual_multiplier=0.5,
                         attention_multiplier=0.2, logits_scaling=4.0)  # fmt: skip


def _olmo2() -> Any:
    from transformers import Olmo2Config

    return Olmo2Config(**COMMON)  # q and k normalised whole; post-norms in every layer


def _mixtral() -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)


def _qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig

    # Layer 1 stays dense (mlp_only_layers): both kinds of layer in one model.
    return Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1],
                          tie_word_embeddings=True)  # fmt: skip


def _olmoe() -> Any:
    from transformers import OlmoeConfig

    # clip_qkv low enough that the random model's q, k and v are clamped.
    return OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, clip_qkv=2.0)


FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": _llama,
    "llama3_rope": _llama3_rope,
    "yarn_rope": _yarn_rope,
    "dynamic_rope": _dynamic_rope,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "phi3": _phi3,
    "phi3_longrope": _phi3_longrope,
    "granite": _granite,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "olmo2": _olmo2,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "olmoe": _olmoe,
}
# name -> engine options
REGIMES: dict[str, dict[str, Any]] = {
    "all_at_once": {},
    "chunked_prefill": {"max_num_batched_tokens": 24},
    "preemption": {"num_kv_blocks": 20, "block_size": 8, "max_model_len": 160},
    "no_cpu_kernels": {"cpu_kernels": False},
}


def _workload() -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(7)
    prefix = rng.integers(3, VOCAB_SIZE, size=24).tolist()
    prompts = []
    for i, length in enumerate(rng.integers(1, 90, size=NUM_PROMPTS)):
        tail = rng.integers(3, VOCAB_SIZE, size=int(length)).tolist()
        prompts.append(prefix + tail if i % 2 else tail)  # shared prefixes, for the cache
    return prompts, rng.integers(1, 24, size=NUM_PROMPTS).tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    default_model_dir: Path,
) -> Any:
    """(model dir, prompts, max tokens, transformers' greedy outputs, its model)."""
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    config = FAMILIES[name]()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(folder)
    for file in TOKENIZER_FILES:
        if (default_model_dir / file).is_file():
            shutil.copy(default_model_dir / file, folder / file)
    prompts, max_tokens = _workload()
    hf = load_hf_model(folder)
    return folder, prompts, max_tokens, hf_greedy(hf, prompts, max_tokens), hf


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return [out.token_ids for out in llm.generate(prompts, params)]


# A rope variant changes only the rotary tables, which the fused and the plain path each
# read; the scheduling regimes are its family's (llama, phi3), run in full there.
ROPE_VARIANTS = ["llama3_rope", "yarn_rope", "dynamic_rope", "phi3_longrope"]
FULL_FAMILIES = [name for name in FAMILIES if name not in ROPE_VARIANTS]


@pytest.mark.parametrize("regime", ["all_at_once", "no_cpu_kernels"])
@pytest.mark.parametrize("family", ROPE_VARIANTS, indirect=True)
def test_a_rope_variant_matches_transformers(family: Any, regime: str) -> None:
    _assert_greedy_matches_transformers(family, regime)


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("family", FULL_FAMILIES, indirect=True)
def test_greedy_matches_transformers(family: Any, regime: str) -> None:
    _assert_greedy_matches_transformers(family, regime)


def _assert_greedy_matches_transformers(family: Any, regime: str) -> None:
    folder, prompts, max_tokens, expected, _ = family
    options = REGIMES[regime]
    if regime == "preemption" and load_model_spec(folder).attention_span:
        # Its requests hold only their window's blocks: a smaller cache, in prompt chunks.
        options = {**options, "num_kv_blocks": 12, "max_num_batched_tokens": 16}
    # transformers stops at EOS; the engine is told to ignore it, so compare up to there.
    llm = LLM(str(folder), **options)
    got = _greedy(llm, prompts, max_tokens)
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g[: len(e)] != e]
    assert not mismatches, f"prompts {mismatches} differ from transformers"
    if regime == "all_at_once":  # the same prompts again: served from the prefix cache
        assert _greedy(llm, prompts, max_tokens) == got
        assert llm.engine_core.scheduler.make_stats().prefix_cache_hits > 0
    if regime == "preemption":
        assert llm.engine_core.scheduler.make_stats().num_preemptions > 0
    assert_kv_cache_clean(llm)


def test_logprobs_match_transformers(family: Any) -> None:
    folder, prompts, _, _, hf = family
    llm = LLM(str(folder))
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    for prompt in prompts[:4]:
        [out] = llm.generate([prompt], params)
        reference = hf_token_logprobs(hf, prompt, out.token_ids)
        for step, entry in enumerate(out.logprobs):
            assert abs(entry.logprob - reference[step, entry.token_id].item()) < 1e-3


def test_the_spec_reads_each_familys_traits(family: Any) -> None:
    folder = family[0]
    config = json.loads((folder / "config.json").read_text())
    spec = load_model_spec(folder)
    architecture = config["architectures"][0]
    assert spec.architecture == architecture
    assert spec.attention_bias == (architecture == "Qwen2ForCausalLM")
    assert spec.qk_norm == (
        architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
    )
    window_layers = {"MistralForCausalLM": (0, 1), "Gemma2ForCausalLM": (0,),
                     "Gemma3ForCausalLM": (0, 2)}.get(architecture, ())  # fmt: skip
    assert spec.window_layers == window_layers
    assert spec.sliding_window == (WINDOW if window_layers else None)
    # Only where every layer is windowed can blocks behind the window be released.
    assert spec.attention_span == (WINDOW if architecture == "MistralForCausalLM" else None)
    gemma = architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
    assert spec.sandwich_norms == gemma and spec.norm_offset == (1.0 if gemma else 0.0)
    assert (spec.attn_logit_softcapping, spec.final_logit_softcapping) == (
        (5.0, 20.0) if architecture == "Gemma2ForCausalLM" else (None, None)
    )
    if architecture == "Gemma3ForCausalLM":
        assert spec.local_rope_theta == 10000.0 and spec.rope_theta == 1e6
        assert spec.rope_scaling is not None and spec.rope_scaling["factor"] == 2.0
    olmo = architecture in ("Olmo2ForCausalLM", "OlmoeForCausalLM")
    assert spec.qk_norm_whole == olmo and spec.post_norms == (architecture == "Olmo2ForCausalLM")
    expected_sparse = {"MixtralForCausalLM": (0, 1), "OlmoeForCausalLM": (0, 1),
                       "Qwen3MoeForCausalLM": (0,)}.get(architecture, ())  # fmt: skip
    assert spec.sparse_layers == expected_sparse
    # A whole-q/k norm spans every head: not split over ranks yet (experts are).
    if olmo:
        with pytest.raises(InvalidRequestError) as refused:
            check_divisible(spec, ParallelLayout(2, 1))
        assert refused.value.field == "tensor_parallel_size"
    else:
        check_divisible(spec, ParallelLayout(2, 1))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"], indirect=True)
def test_experts_give_the_same_tokens_alone_and_in_a_batch(family: Any) -> None:
    """A mixture routes each token by itself: a request's tokens do not depend on which
    others share its steps (alone, then among 32)."""
    folder, prompts, _, _, _ = family
    assert load_model_spec(folder).num_experts > 0
    llm = LLM(str(folder))
    batch = (prompts * 2)[:32]
    max_tokens = [12] * len(batch)
    together = _greedy(llm, batch, max_tokens)
    llm.client.reset_prefix_cache()
    alone = [_greedy(llm, [prompt], [12])[0] for prompt in batch[:4]]
    assert alone == together[:4]


@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_a_sliding_window_model_holds_only_its_windows_blocks(family: Any) -> None:
    """A sequence of 300 tokens, ten windows long, in prompt chunks of 16: the same tokens as
    transformers, and the request never holds more KV blocks than its window spans plus the
    chunk it computes (6 blocks of 8), where full attention would hold all 38."""
    folder, prompts, _, _, hf = family
    prompt = [token for p in prompts for token in p][:100]
    [expected] = hf_greedy(hf, [prompt], [200])
    llm = LLM(str(folder), block_size=8, max_num_batched_tokens=16)
    assert llm.engine_core.max_model_len == 512  # the model's positions, not the window
    client, kv_cache = llm.client, llm.engine_core.scheduler.kv_cache
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    client.add_request(EngineCoreRequest(request_id="r", prompt_token_ids=prompt,
                                         sampling_params=params))  # fmt: skip
    tokens: list[int] = []
    held: list[int] = []
    for _ in range(1000):
        outputs = client.get_output().outputs
        held.append(kv_cache.num_blocks_held("r"))
        tokens.extend(token for output in outputs for token in output.new_token_ids)
        if any(output.finished for output in outputs):
            break
    assert tokens[: len(expected)] == expected and len(tokens) == 200
    # Blocks held after each step: while the prompt's chunks run, the window behind a chunk
    # and the chunk (31 + 16 tokens: 6 blocks), then the window behind a decode (31 + 1: at
    # most 5). The whole sequence would need 38 blocks.
    assert max(held) == 6 <= blocks_per_request(300, 8, WINDOW, 16)
    assert max(held[-150:]) == 5 and -(-300 // 8) == 38
    assert_kv_cache_clean(llm)


def test_a_checkpoint_in_several_shards_loads_as_one(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """save_pretrained's shards (model-0000N-of-0000M.safetensors and their index) load as
    the single-file checkpoint does: the same greedy tokens as transformers."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_llama()).to(torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="2MB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) >= 2 and (tmp_path / "model.safetensors.index.json").is_file()
    for file in TOKENIZER_FILES:
        if (default_model_dir / file).is_file():
            shutil.copy(default_model_dir / file, tmp_path / file)
    prompts, max_tokens = _workload()
    expected = hf_greedy(load_hf_model(tmp_path), prompts[:4], max_tokens[:4])
    got = _greedy(LLM(str(tmp_path)), prompts[:4], max_tokens[:4])
    assert [g[: len(e)] for g, e in zip(got, expected, strict=True)] == expected


@pytest.mark.parametrize("family", ["mixtral"], indirect=True)
def test_make_bench_runs_on_the_familys_model(family: Any) -> None:
    """`make bench MODEL=DIR` on a family's model: every output equal to transformers', and
    the figures count the parameters a token runs through (a mixture's routed share)."""
    folder, _, _, _, hf = family
    args = ("--num-prompts 2 --output-len 4 --min-len 4 --max-len 9 --skip-structured "
            "--rounds 1")  # fmt: skip
    done = subprocess.run(
        ["make", "--no-print-directory", "bench", f"MODEL={folder}", f"ARGS={args}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["outputs_equal_hf"] == 2 and summary["ours_tok_s"] > 0
    params = dict(hf.named_parameters())  # a tied embedding once
    experts = sum(p.numel() for name, p in params.items() if ".experts." in name)
    share = hf.config.num_experts_per_tok / hf.config.num_local_experts if experts else 0.0
    dense = sum(p.numel() for name, p in params.items() if ".experts." not in name)
    assert summary["num_params"] == dense + round(experts * share)
