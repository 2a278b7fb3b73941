"""One choice's assembly: stop strings cut tokens and text at the token that completed them,
the engine's finish flushes held text, logprobs stay aligned with tokens."""

from __future__ import annotations

from frontend_svc.choice import ChoiceState
from frontend_svc.messages import EngineOutput, FinishReason, SamplingOptions, TokenLogprobs
from frontend_svc.tokenizer import Tokenizer


def output(
    token_ids: list[int], finish: FinishReason | None = None, **fields: object
) -> EngineOutput:
    return EngineOutput(new_token_ids=tuple(token_ids), finish_reason=finish, **fields)  # type: ignore[arg-type]


def test_a_stop_string_spanning_two_tokens_ends_the_choice(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(" the quick brown fox jumps")
    pieces = [tokenizer.decode([t], True) for t in token_ids]
    assert pieces[1:3] == [" quick", " brown"]
    stop = "ick bro"  # the end of one token and the start of the next
    choice = ChoiceState(0, tokenizer, SamplingOptions(stop=(stop,)))
    # All tokens in one engine message: the cut still falls at the completing token.
    assert choice.add(output(token_ids)) is True  # the engine request must be aborted
    delta = choice.take_delta()
    assert delta is not None
    assert (delta.text, delta.token_ids) == (" the qu", token_ids[:3])
    assert (delta.finish_reason, delta.stop_reason) == (FinishReason.STOP, stop)
    assert choice.is_finished and choice.add(output([5])) is False


def test_a_stop_string_cuts_at_its_token_when_that_token_also_begins_a_character(
    tokenizer: Tokenizer,
) -> None:
    token_ids = tokenizer.encode("a 😀b")  # 40303: " " and the emoji's first bytes
    choice = ChoiceState(0, tokenizer, SamplingOptions(stop=("a ",)))
    for token_id in token_ids:  # one token a message, as the engine streams them
        if choice.add(output([token_id])):
            break
    delta = choice.take_delta()
    assert delta is not None
    assert (delta.text, delta.token_ids, choice.num_tokens) == ("", token_ids[:2], 2)


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer: Tokenizer) -> None:
    options = SamplingOptions(stop=("brown",), include_stop_str_in_output=True)
    choice = ChoiceState(0, tokenizer, options)
    choice.add(output(tokenizer.encode(" the quick brown fox")))
    delta = choice.take_delta()
    assert delta is not None and delta.text == " the quick brown"


def test_the_engine_finish_releases_held_text(tokenizer: Tokenizer) -> None:
    choice = ChoiceState(0, tokenizer, SamplingOptions(stop=("quick!",)))
    assert choice.add(output(tokenizer.encode(" the quick"))) is False
    first = choice.take_delta()
    assert first is not None and first.text == " the "  # "quick" might become "quick!"
    assert choice.add(output([2], FinishReason.STOP, stop_token_id=None)) is False
    last = choice.take_delta()
    assert last is not None
    assert (last.text, last.token_ids, last.finish_reason) == ("quick", [2], FinishReason.STOP)
    assert choice.take_delta() is None


def test_stop_token_ids_and_logprobs_come_through(tokenizer: Tokenizer) -> None:
    choice = ChoiceState(1, tokenizer, SamplingOptions(logprobs=0))
    logprobs = tuple(TokenLogprobs(t, -0.5, 1, (), ()) for t in (100, 200))
    choice.add(output([100, 200], FinishReason.STOP, stop_token_id=200, new_logprobs=logprobs))
    delta = choice.take_delta()
    assert delta is not None
    assert (delta.index, delta.token_ids, delta.logprobs) == (1, [100, 200], list(logprobs))
    assert delta.stop_reason == 200
    assert choice.num_tokens == 2
