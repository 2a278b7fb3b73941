"""`--stream-interval N`: a served stream's first token goes out at once, then the tokens
leave N (or more, when the reader lags) to a message, and the last output at once: the same
tokens in fewer messages."""

from __future__ import annotations

from pathlib import Path

import grpc

from engine_svc import LLM, SamplingParams
from tests.service_processes import engine_stub, generate_request, run_async, start_service

INTERVAL = 4
MAX_TOKENS = 11


def test_tokens_leave_in_groups_of_the_interval(tiny_model_dir: Path, tmp_path: Path) -> None:
    prompt = [5, 17, 901, 44, 3002, 12]
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        [expected] = llm.generate([prompt], params)
    finally:
        llm.shutdown()
    service = start_service(
        tiny_model_dir, tmp_path / "service.log", "--stream-interval", str(INTERVAL),
        "--num-kv-blocks", "64",
    )  # fmt: skip
    try:

        async def body() -> list[list[int]]:
            async with grpc.aio.insecure_channel(service.address) as channel:
                request = generate_request("grouped", prompt, MAX_TOKENS, ignore_eos=True)
                return [list(r.token_ids) async for r in engine_stub(channel).Generate(request)]

        messages = run_async(body)
    finally:
        service.stop()
    assert [t for message in messages for t in message] == expected.token_ids
    # The first message leaves with the first token (more only if the reader lagged); every
    # later one but the last waited for INTERVAL tokens.
    assert all(len(message) >= INTERVAL for message in messages[1:-1])
    # At one token a message there would be 11; a reader that lags only merges more.
    assert len(messages) <= 2 + (MAX_TOKENS - 1) // INTERVAL
