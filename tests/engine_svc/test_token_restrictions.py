"""allowed_token_ids and bad words (vLLM's SamplingParams): greedy outputs equal those of
transformers' own processors for them on the same weights, sampled outputs keep to them, and
a request they leave no token is refused at admission or ended naming the field."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from engine_svc import LLM, SamplingParams
from engine_svc.messages import EngineCoreRequest
from engine_svc.worker.sampler import Sampler, SamplingRow
from shared.errors import InvalidRequestError
from tests.engine_svc.engine_helpers import assert_kv_cache_clean
from tests.engine_svc.hf_reference import load_hf_model

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=256)


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> torch.nn.Module:
    return load_hf_model(tiny_model_dir)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 49152) for _ in range(rng.randrange(5, 30))] for _ in range(count)]


@torch.inference_mode()
def _hf_greedy(hf: torch.nn.Module, prompt: list[int], **processors: object) -> list[int]:
    ids = torch.tensor([prompt])
    generated = hf.generate(  # type: ignore[operator]
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        **processors,
    )
    return list(generated[0, len(prompt) :].tolist())


def test_greedy_with_allowed_token_ids_equals_hf_prefix_allowed_tokens(
    llm: LLM, hf: torch.nn.Module
) -> None:
    """transformers' PrefixConstrainedLogitsProcessor keeps the same tokens of the same
    float32 logits: greedy outputs stay equal token for token."""
    rng = random.Random(3)
    prompts = _prompts(4, seed=5)
    allowed = sorted(rng.sample(range(1, 49152), 64))
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, allowed_token_ids=allowed)
    outputs = [out.token_ids for out in llm.generate(prompts, params)]
    expected = [
        _hf_greedy(hf, prompt, prefix_allowed_tokens_fn=lambda _batch, _ids: allowed)
        for prompt in prompts
    ]
    assert outputs == expected
    assert all(set(out) <= set(allowed) for out in outputs)
    # The restriction changed something: unrestricted, the model picks other tokens.
    assert any(not set(out.token_ids) <= set(allowed) for out in plain)
    assert_kv_cache_clean(llm)


def test_greedy_with_bad_words_equals_hf_no_bad_words(llm: LLM, hf: torch.nn.Module) -> None:
    """Each prompt bans its own unrestricted output's first token (a one-token word: never
    sampled) and a pair from later in it (its second token masked wherever the output ends
    with its first); transformers' NoBadWordsLogitsProcessor gives the same greedy tokens."""
    prompts = _prompts(4, seed=9)
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for prompt, out in zip(prompts, plain, strict=True):
        assert len(out.token_ids) == MAX_TOKENS  # no EOS among them, random prompts
        first, pair = out.token_ids[0], out.token_ids[4:6]
        # transformers matches a word's prefix against the prompt too, this engine (as
        # vLLM) against the output alone: the two agree unless the prompt ends with it.
        assert prompt[-1] != pair[0]
        words = [[first], pair]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, bad_words_token_ids=words)
        got = llm.generate([prompt], params)[0].token_ids
        assert got == _hf_greedy(hf, prompt, bad_words_ids=words)
        assert first not in got
        assert all(got[i : i + 2] != pair for i in range(len(got) - 1))
    assert_kv_cache_clean(llm)


def test_bad_words_as_text_are_tokenized_by_the_offline_api(llm: LLM) -> None:
    """vLLM's offline `bad_words`: LLM tokenizes each word (as it begins a text and after a
    space) and adds them to any given as token ids; the engine itself takes token ids only.
    A bias of +100 makes "hello" and " hello" every greedy token; banned, neither comes."""
    (hello,), (spaced_hello,) = (
        llm.tokenizer.encode(text, add_special_tokens=False) for text in ("hello", " hello")
    )
    forced = {"temperature": 0.0, "max_tokens": 6, "logit_bias": {hello: 100.0, spaced_hello: 99.0}}
    by_text = SamplingParams(**forced, bad_words_token_ids=[[7]], bad_words=["hello"])  # type: ignore[arg-type]
    by_ids = SamplingParams(**forced, bad_words_token_ids=[[7], [hello], [spaced_hello]])  # type: ignore[arg-type]
    prompt = _prompts(1, seed=13)[0]
    plain, got_text, got_ids = llm.generate(
        [prompt] * 3, [SamplingParams(**forced), by_text, by_ids]
    )  # type: ignore[arg-type]
    assert len(plain.token_ids) == 6 and set(plain.token_ids) <= {hello, spaced_hello}
    assert got_text.token_ids == got_ids.token_ids and len(got_text.token_ids) == 6
    assert not {hello, spaced_hello, 7} & set(got_text.token_ids)
    with pytest.raises(InvalidRequestError) as raised:
        request = EngineCoreRequest(
            request_id="r", prompt_token_ids=[1, 2], sampling_params=SamplingParams(bad_words=["x"])
        )
        llm.client.add_request(request)  # the engine's own client, past LLM's tokenizer
    assert raised.value.field == "bad_words"
    with pytest.raises(InvalidRequestError, match="not one string"):
        llm.generate([[1, 2]], SamplingParams(bad_words="hello"))  # type: ignore[arg-type]


def test_sampled_tokens_keep_to_allowed_token_ids_and_bad_words(llm: LLM) -> None:
    allowed = [11, 12, 13, 14]
    words = [[12], [13, 13], [11, 14]]
    params = [
        SamplingParams(
            temperature=1.5,
            seed=seed,
            max_tokens=32,
            ignore_eos=True,
            allowed_token_ids=allowed,
            bad_words_token_ids=words,
        )
        for seed in (None, 1, 2, 3)
    ]
    for out in llm.generate(_prompts(4, seed=1), params):
        tokens = out.token_ids
        assert len(tokens) == 32 and set(tokens) <= {11, 13, 14}
        pairs = set(itertools.pairwise(tokens))
        assert not pairs & {(13, 13), (11, 14)}
    assert_kv_cache_clean(llm)


@pytest.mark.parametrize(
    ("allowed", "words"),
    [
        ([11, 12], [[a, b] for a in (11, 12) for b in (11, 12)]),
        # Each id counted once (four ids listed, two distinct), the words given as tuples.
        ([11, 12, 11, 12], [(a, b) for a in (11, 12) for b in (11, 12)]),
    ],
)
def test_a_request_left_no_token_ends_naming_the_field(
    llm: LLM, allowed: list[int], words: list[Sequence[int]]
) -> None:
    """Two allowed tokens and every pair of them banned: the first token is fine, then
    nothing may follow. The request ends with an error after its one token, its blocks
    freed; one beside it runs on."""
    stuck = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        allowed_token_ids=allowed,
        bad_words_token_ids=words,  # type: ignore[arg-type]  # tuples, as a caller may pass
    )
    fine = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out_stuck, out_fine = llm.generate(_prompts(2, seed=4), [stuck, fine])
    assert out_stuck.finish_reason == "error"
    assert out_stuck.token_ids[0] in (11, 12) and len(out_stuck.token_ids) == 1
    assert out_stuck.error is not None and "no token can follow the 1 generated" in out_stuck.error
    assert out_fine.finish_reason == "length" and len(out_fine.token_ids) == 8
    assert_kv_cache_clean(llm)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(allowed_token_ids=[]), "allowed_token_ids"),
        (SamplingParams(allowed_token_ids=[-1]), "allowed_token_ids"),
        (SamplingParams(allowed_token_ids=[49152]), "allowed_token_ids"),
        (SamplingParams(bad_words_token_ids=[[]]), "bad_words_token_ids"),
        (SamplingParams(bad_words_token_ids=[[5, 49152]]), "bad_words_token_ids"),
        # Every allowed token banned by a one-token word.
        (
            SamplingParams(allowed_token_ids=[5, 6], bad_words_token_ids=[[5], [6]]),
            "bad_words_token_ids",
        ),
        (
            SamplingParams(allowed_token_ids=[5, 5], bad_words_token_ids=[[5]]),
            "bad_words_token_ids",
        ),
        # Only EOS allowed (the tiny model's is 2), held back by min_tokens.
        (SamplingParams(allowed_token_ids=[2], min_tokens=2), "allowed_token_ids"),
    ],
)
def test_restrictions_that_cannot_run_are_refused_naming_the_field(
    llm: LLM, params: SamplingParams, field: str
) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        llm.generate([[1, 2, 3]], params)
    assert raised.value.field == field


def test_logprobs_stay_the_models_own_under_allowed_token_ids() -> None:
    """The mask moves the draw, not the logprobs (vLLM's default: the raw model output)."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    params = SamplingParams(temperature=0.0, allowed_token_ids=[0, 2], logprobs=1)
    tokens, logprobs = Sampler(torch.device("cpu"))(logits, [SamplingRow(params, 0, [9], [])])
    assert tokens == [2]
    entry = logprobs[0]
    assert entry is not None
    raw = torch.log_softmax(logits[0], dim=-1)
    assert entry.logprob == pytest.approx(float(raw[2]))
    assert entry.top_token_ids == [1]  # the model's most likely, though not allowed
