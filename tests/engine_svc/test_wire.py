"""The ZMQ wire protocol: every message type round-trips as msgpack, never pickle."""

from __future__ import annotations

import msgspec
import pytest

from engine_svc import control_messages as control
from engine_svc.config import EngineConfig
from engine_svc.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from engine_svc.proc import wire
from engine_svc.sampling_params import SamplingParams
from shared.engine_load import RankLoad

REQUEST = EngineCoreRequest(
    request_id="r1", prompt_token_ids=[1, 2], sampling_params=SamplingParams(max_tokens=None)
)


@pytest.mark.parametrize(
    ("request_type", "payload"),
    [
        (wire.RequestType.ADD, REQUEST),
        (wire.RequestType.ABORT, ["a", "b"]),
        (wire.RequestType.UTILITY, control.UtilityCall(7, control.UtilityMethod.GET_LOAD)),
        (wire.RequestType.SHUTDOWN, control.ShutdownRequest(2.5)),
    ],
)
def test_requests_round_trip(request_type: wire.RequestType, payload: wire.EngineInput) -> None:
    frames = wire.encode_request(request_type, payload)
    assert len(frames[0]) == 1  # the one-byte request type
    assert wire.decode_request(frames) == (request_type, payload)


@pytest.mark.parametrize(
    ("output_type", "payload"),
    [
        (wire.OutputType.READY, control.EngineInfo(0, 1024, 49152, [2], 16, 256, 8)),
        (
            wire.OutputType.OUTPUTS,
            EngineCoreOutputs(
                outputs=[
                    EngineCoreOutput(
                        request_id="r", new_token_ids=[3], finish_reason=FinishReason.STOP
                    )
                ]
            ),
        ),
        (wire.OutputType.REJECTED, control.RequestRejected("r", "prompt_token_ids", "empty")),
        (wire.OutputType.UTILITY_RESULT, control.UtilityResult(1, RankLoad(1, 2, 0.5, 9))),
        (wire.OutputType.UTILITY_RESULT, control.UtilityResult(2, True)),
        (wire.OutputType.ENGINE_CORE_DEAD, control.EngineDead("boom")),
    ],
)
def test_outputs_round_trip_with_the_sending_rank(
    output_type: wire.OutputType, payload: wire.EngineOutput
) -> None:
    frames = wire.encode_output(output_type, 3, payload)
    assert wire.decode_output(frames) == (output_type, 3, payload)


def test_an_add_that_does_not_decode_still_yields_its_request_id() -> None:
    # A value of the wrong type (values in range are admission's business, not the codec's).
    bad = msgspec.msgpack.encode(["r9", [1], {"temperature": "hot"}])
    with pytest.raises(msgspec.ValidationError):
        wire.decode_request([bytes([wire.RequestType.ADD]), bad])
    assert wire.request_id_of(bad) == "r9"
    assert wire.request_id_of(b"\xc1") is None


def test_process_arguments_round_trip() -> None:
    args = wire.EngineProcArgs(
        config=EngineConfig(model="/m", max_model_len=64, enable_prefix_caching=False),
        input_address="ipc:///tmp/x/input-0",
        output_address="ipc:///tmp/x/output",
        engine_index=1,
        shutdown_timeout_s=5.0,
    )
    assert wire.decode_proc_args(wire.encode_proc_args(args)) == args
