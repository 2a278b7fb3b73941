"""Sampling through the whole engine: logprobs against HF, seeds, and each parameter's effect."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_svc import LLM, SamplingParams
from engine_svc.worker.sampler import Sampler, SamplingRow
from tests.engine_svc.engine_helpers import assert_kv_cache_clean, generate_staggered
from tests.engine_svc.hf_reference import hf_token_logprobs, load_hf_model


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=512)


def _prompts(count: int, seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 49152, size=int(n)).tolist() for n in rng.integers(4, 60, size=count)]


@pytest.mark.default_model
def test_logprobs_match_hf_log_softmax(default_model_dir: Path) -> None:
    llm = LLM(str(default_model_dir), max_model_len=512, num_kv_blocks=64)
    prompts = [llm.tokenizer.encode(t) for t in ("The weather today is", "1, 2, 3,", "Dear Sir,")]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5)
    outputs = llm.generate(prompts, params)
    hf = load_hf_model(default_model_dir)
    for prompt, out in zip(prompts, outputs, strict=True):
        reference = hf_token_logprobs(hf, prompt, out.token_ids)
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        for position, entry in enumerate(out.logprobs):
            expected = reference[position]
            assert entry.token_id == out.token_ids[position]
            assert abs(entry.logprob - expected[entry.token_id].item()) < 1e-3
            assert entry.rank == 1  # greedy picks the most likely token
            assert len(entry.top_token_ids) == 5
            assert entry.top_token_ids[0] == entry.token_id
            top_expected = expected[entry.top_token_ids]
            assert np.allclose(entry.top_logprobs, top_expected.tolist(), atol=1e-3)
    assert_kv_cache_clean(llm)


def test_seeded_sampling_ignores_the_rest_of_the_batch(llm: LLM) -> None:
    target = _prompts(1, seed=1)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([target], seeded)[0].token_ids
    others = _prompts(7, seed=2)
    noisy = [SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True) for _ in others]
    # The seeded request joins a busy batch at a later step, behind other prompts.
    mixed = generate_staggered(llm, [*others, target], [*noisy, seeded], [0] * 7 + [3])
    assert mixed[-1] == alone
    assert llm.generate([target], seeded)[0].token_ids == alone
    different = llm.generate([target], SamplingParams(temperature=1.0, seed=99, max_tokens=24))
    assert different[0].token_ids != alone
    assert_kv_cache_clean(llm)


def test_top_k_one_and_tiny_top_p_are_greedy(llm: LLM) -> None:
    prompts = _prompts(4)
    greedy = [
        o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    ]
    for params in (
        SamplingParams(temperature=1.5, top_k=1, max_tokens=8),
        SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=8),
        SamplingParams(temperature=1.5, min_p=1.0, max_tokens=8),
    ):
        assert [o.token_ids for o in llm.generate(prompts, params)] == greedy


@pytest.mark.parametrize(
    "penalty",
    [{"frequency_penalty": 0.5}, {"presence_penalty": 0.5}, {"repetition_penalty": 1.5}],
)
def test_penalties_turn_away_from_seen_tokens(penalty: dict[str, float]) -> None:
    # Token 5 leads token 6 by a little; having produced 5 before flips the choice.
    logits = torch.zeros(2, 16)
    logits[:, 5], logits[:, 6] = 2.2, 2.0
    plain = SamplingParams(temperature=0.0)
    penalized = SamplingParams(temperature=0.0, **penalty)
    rows = [
        SamplingRow(plain, output_index=1, prompt_token_ids=[1], output_token_ids=[5]),
        SamplingRow(penalized, output_index=1, prompt_token_ids=[1], output_token_ids=[5]),
    ]
    tokens, _ = Sampler(torch.device("cpu"))(logits, rows)
    assert tokens == [5, 6]


def test_greedy_in_bfloat16_picks_what_float32_picks_ties_included() -> None:
    """Plain greedy rows take the argmax of the logits' own dtype (no float32 copy); rows
    that want logprobs go through float32. Both pick the first of tied maxima."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=generator).bfloat16()
    logits[0, 17] = logits[0, 240] = 9.0  # a tie: the first wins
    logits[1, 5] = logits[1, 6] = logits[1, 7] = 8.0
    plain = [SamplingRow(SamplingParams(temperature=0.0), 0, [1], []) for _ in range(6)]
    with_logprobs = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=1), 0, [1], []) for _ in range(6)
    ]
    sampler = Sampler(torch.device("cpu"))
    tokens, logprobs = sampler(logits, plain)
    assert tokens[:2] == [17, 5] and logprobs == [None] * 6
    assert tokens == logits.float().max(dim=-1).indices.tolist()
    assert sampler(logits, with_logprobs)[0] == tokens


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.zeros(3, 16)
    logits[:, 7] = 50.0  # by far the most likely token in every row
    rows = [
        SamplingRow(SamplingParams(temperature=0.0), 0, [1], [], banned_token_ids=(7,)),
        SamplingRow(SamplingParams(temperature=1.0, seed=3), 0, [1], [], banned_token_ids=(7,)),
        SamplingRow(SamplingParams(temperature=0.0), 0, [1], []),
    ]
    for _ in range(20):
        tokens, _ = Sampler(torch.device("cpu"))(logits, rows)
        assert tokens[0] != 7 and tokens[1] != 7 and tokens[2] == 7


def test_logit_bias_moves_the_draw_and_not_the_logprobs() -> None:
    logits = torch.zeros(4, 16)
    logits[:, 7], logits[:, 3] = 5.0, 4.0
    biased = {7: -0.5, 3: 0.5625}  # 4.5 against 4.5625: token 3 now leads, by a hair
    rows = [
        SamplingRow(SamplingParams(temperature=0.0), 0, [1], []),
        SamplingRow(SamplingParams(temperature=0.0, logit_bias=biased, logprobs=1), 0, [1], []),
        # Seeded and unseeded draws see the bias too: +100 makes token 11 all but certain.
        SamplingRow(SamplingParams(temperature=1.0, seed=5, logit_bias={11: 100.0}), 0, [1], []),
        SamplingRow(SamplingParams(temperature=1.0, logit_bias={11: 100.0}), 0, [1], []),
    ]
    tokens, logprobs = Sampler(torch.device("cpu"))(logits, rows)
    assert tokens == [7, 3, 11, 11]
    entry = logprobs[1]
    assert entry is not None and entry.token_id == 3
    # The model's own distribution: token 3 is second there, at its unbiased logprob.
    assert entry.rank == 2 and entry.top_token_ids == [7]
    assert entry.logprob == pytest.approx(torch.log_softmax(logits[1], -1)[3].item())


def test_logit_bias_comes_after_the_min_tokens_mask_and_before_penalties() -> None:
    logits = torch.zeros(2, 16)
    logits[:, 7], logits[:, 3] = 2.0, 1.0
    # A held-back token stays out whatever its bias.
    held_back = SamplingParams(temperature=0.0, logit_bias={7: 100.0})
    # Biased to 3.0 before a repetition penalty of 2 halves it to 1.5: token 3 loses to 7's
    # 2.0 (penalizing first, then biasing, would give 0.5 + 2.5 = 3.0 and pick it).
    penalized = SamplingParams(temperature=0.0, logit_bias={3: 2.0}, repetition_penalty=2.0)
    rows = [
        SamplingRow(held_back, 0, [1], [], banned_token_ids=(7,)),
        SamplingRow(penalized, 1, [1], [3]),
    ]
    tokens, _ = Sampler(torch.device("cpu"))(logits, rows)
    assert tokens == [3, 7]


def test_greedy_with_logit_bias_equals_hf_sequence_bias(llm: LLM, tiny_model_dir: Path) -> None:
    """transformers' SequenceBiasLogitsProcessor adds the same float32 biases to the same
    float32 logits: greedy outputs stay equal token for token."""
    prompts = _prompts(4, seed=21)
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=2))
    # Lift each prompt's second most likely first token just past the first (logit gaps are
    # logprob gaps), and push an arbitrary token down.
    outputs, expected, runners_up = [], [], []
    hf = load_hf_model(tiny_model_dir)
    for prompt, out in zip(prompts, plain, strict=True):
        assert out.logprobs is not None
        top = out.logprobs[0]
        runner_up = top.top_token_ids[1]
        runners_up.append(runner_up)
        bias = {runner_up: top.top_logprobs[0] - top.top_logprobs[1] + 0.01, 4321: -1.25}
        params = SamplingParams(temperature=0.0, max_tokens=12, logit_bias=bias)
        outputs.append(llm.generate([prompt], params)[0].token_ids)
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            generated = hf.generate(  # type: ignore[operator]
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=12,
                do_sample=False,
                sequence_bias={(t,): b for t, b in bias.items()},
            )
        expected.append(generated[0, len(prompt) :].tolist())
    assert outputs == expected
    assert [o[0] for o in outputs] == runners_up
    assert_kv_cache_clean(llm)


def test_min_tokens_masks_eos_until_reached(llm: LLM, tiny_model_dir: Path, tmp_path: Path) -> None:
    """A prompt whose greedy output is EOS at once: with min_tokens, exactly min_tokens
    tokens come out, none of them EOS (masked, not merely ignored when sampled)."""
    prompt = _prompts(1, seed=11)[0]
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]
    # The same weights, with that first token declared the EOS.
    model_dir = tmp_path / "eos-first"
    model_dir.mkdir()
    for path in tiny_model_dir.iterdir():
        (model_dir / path.name).symlink_to(path)
    (model_dir / "generation_config.json").unlink(missing_ok=True)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": first}))
    eos_first = LLM(str(model_dir), max_model_len=256, num_kv_blocks=16)
    ends = eos_first.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0]
    assert (ends.token_ids, ends.finish_reason) == ([first], "stop")
    held = SamplingParams(temperature=0, min_tokens=6, max_tokens=6, logprobs=1)
    out = eos_first.generate([prompt], held)[0]
    assert len(out.token_ids) == 6 and first not in out.token_ids
    # The logprobs are the model's: EOS stays the top token where it was masked.
    assert out.logprobs is not None and out.logprobs[0].top_token_ids == [first]
    ignoring = SamplingParams(temperature=0, min_tokens=3, max_tokens=3, ignore_eos=True)
    assert eos_first.generate([prompt], ignoring)[0].token_ids[0] == first
    assert_kv_cache_clean(eos_first)


def test_stop_token_ids_min_tokens_and_eos(llm: LLM) -> None:
    prompt = _prompts(1, seed=4)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    stopped = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at])
    )[0]
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_at)
    # min_tokens holds a stop token back until enough tokens exist.
    held = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0, max_tokens=20, stop_token_ids=[stop_at], min_tokens=first + 2
        ),
    )[0]
    assert len(held.token_ids) > first + 1
    assert stop_at not in held.token_ids[: first + 2]  # masked, never sampled, until then
    assert free.finish_reason == "length" and len(free.token_ids) == 20
