"""Requests Python's protobuf cannot build: a `string` field holding bytes that are not UTF-8
(a lone surrogate, 0xFF, an overlong form), as a client in another language can send them.
The message is serialized, then the raw field appended in wire format (a later occurrence of
a field is as valid as an earlier one), and the bytes sent on a channel that passes them
through unchanged."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf.message import Message
from hypothesis import strategies as st

LENGTH_DELIMITED = 2


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if not value:
            return bytes(out + bytes([low]))
        out.append(low | 0x80)


def _field(number: int, raw: bytes) -> bytes:
    return _varint(number << 3 | LENGTH_DELIMITED) + _varint(len(raw)) + raw


def with_raw_string(message: Message, path: Sequence[str], raw: bytes) -> bytes:
    """`message` serialized with the string field at `path` (field names, through singular
    or repeated submessages) set to `raw`: a repeated field gains one element, a singular
    one is replaced."""
    name, *rest = path
    descriptor = message.DESCRIPTOR.fields_by_name[name]
    if descriptor.is_repeated:
        if rest:
            element = getattr(type(message)(), name).add()  # a fresh, empty one
            raw = with_raw_string(element, rest, raw)
        return message.SerializeToString() + _field(descriptor.number, raw)
    if rest:
        raw = with_raw_string(getattr(message, name), rest, raw)
    others = type(message)()
    others.CopyFrom(message)
    others.ClearField(name)
    return others.SerializeToString() + _field(descriptor.number, raw)


def send_raw(
    channel: grpc.Channel, method: str, raw: bytes, streaming: bool, timeout_s: float = 60.0
) -> None:
    """Call `method` ("/package.Service/Method") with `raw` as the request, reading every
    response of a server stream; raises grpc.RpcError as a stub would."""
    identity = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    if streaming:
        list(channel.unary_stream(method, **identity)(raw, timeout=timeout_s))
    else:
        channel.unary_unary(method, **identity)(raw, timeout=timeout_s)


LONE_SURROGATES = st.integers(0xD800, 0xDFFF).map(lambda c: chr(c).encode("utf-8", "surrogatepass"))
# Never valid wherever they stand after a whole character: bytes no UTF-8 has, a stray
# continuation byte, overlong forms, beyond U+10FFFF; and a truncated character, completed
# by no character that may follow it.
NOT_UTF8 = st.sampled_from(
    [
        b"\xff",
        b"\xfe",
        b"\xff\xfe",
        b"\x80",
        b"\xc0\xaf",
        b"\xe0\x80\xaf",
        b"\xf4\x90\x80\x80",
        b"\xe2\x82",
    ]
)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


INVALID_UTF8 = st.builds(
    lambda before, bad, after: before.encode() + bad + after.encode(),
    st.text(max_size=8),
    st.one_of(LONE_SURROGATES, NOT_UTF8),
    st.text(max_size=8),
).filter(lambda raw: not _is_utf8(raw))
