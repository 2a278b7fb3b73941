"""Talking to a frontend subprocess (tests/service_processes.py starts it): its stub, greedy
sampling options, and the texts a stream gives."""

from __future__ import annotations

from typing import Any

import grpc

from shared.frontend_protos import frontend_pb2 as fpb
from shared.frontend_protos import frontend_pb2_grpc


def frontend_stub(channel: grpc.aio.Channel) -> frontend_pb2_grpc.GenerationServiceStub:
    return frontend_pb2_grpc.GenerationServiceStub(channel)


def greedy(max_tokens: int, **fields: Any) -> fpb.SamplingParams:
    return fpb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **fields)


async def stream_texts(
    stub: frontend_pb2_grpc.GenerationServiceStub, request: fpb.GenerateRequest
) -> tuple[list[str], list[int], list[fpb.GenerateResponse]]:
    """Choice 0's text deltas and token ids, and every response."""
    responses = [r async for r in stub.GenerateStream(request, timeout=60)]
    deltas = [c.text for r in responses for c in r.choices if c.index == 0]
    token_ids = [t for r in responses for c in r.choices if c.index == 0 for t in c.token_ids]
    return deltas, token_ids, responses
