"""The token plane's wire: frames round-trip, and a frame that is forged, replayed, reordered
or malformed is refused; the handshake admits only a peer holding the cluster's token."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from pdserve.engine.logprobs import TokenLogprobs
from pdserve.planes.link import HEADER_BYTES, FrameReader, FrameWriter, PlaneAuthError, PlaneError
from pdserve.planes.token_wire import (
    TOKEN_PLANE,
    TokenEntry,
    decode_logprobs,
    encode_logprobs,
    parse_entries,
)

KEY = bytes(range(32))
ENTRY = TokenEntry("req-1", [5, 6], "héllo", None, 2, 0, None, None, -1)


def reader(key: bytes) -> FrameReader:
    return FrameReader(key, TOKEN_PLANE)


def read_all(data: bytes, reader: FrameReader) -> list[list[TokenEntry]]:
    async def run() -> list[list[TokenEntry]]:
        stream = asyncio.StreamReader()
        stream.feed_data(data)
        stream.feed_eof()
        frames = []
        try:
            while True:
                frames.append(parse_entries(await reader.read(stream)))
        except asyncio.IncompleteReadError:
            return frames

    return asyncio.run(run())


def test_frames_round_trip_in_order() -> None:
    writer = FrameWriter(KEY)
    last = TokenEntry("req-2", [7], "!", "length", 3, 16, None, [16, 0, None, None, None], 6)
    data = writer.frame([ENTRY]) + writer.frame([ENTRY, last])
    frames = read_all(data, reader(KEY))
    assert frames == [[ENTRY], [ENTRY, last]]
    assert frames[1][1].finish_reason == "length" and frames[1][1].prev_token_id == 6


@pytest.mark.parametrize("tamper", ["payload", "mac", "key"])
def test_a_frame_whose_mac_does_not_verify_is_refused(tamper: str) -> None:
    frame = bytearray(FrameWriter(KEY).frame([ENTRY]))
    key = KEY
    if tamper == "payload":
        frame[-3] ^= 1
    elif tamper == "mac":
        frame[HEADER_BYTES - 1] ^= 1
    else:
        key = bytes(32)
    with pytest.raises(PlaneAuthError, match="MAC"):
        read_all(bytes(frame), reader(key))


def test_a_replayed_or_skipped_frame_is_refused() -> None:
    writer = FrameWriter(KEY)
    first, second = writer.frame([ENTRY]), writer.frame([ENTRY])
    with pytest.raises(PlaneError, match="out of order"):
        read_all(first + first, reader(KEY))
    with pytest.raises(PlaneError, match="out of order"):
        read_all(second, reader(KEY))


def test_a_well_signed_frame_that_is_not_entries_is_refused() -> None:
    for content in ({"a": 1}, [[1, 2, 3]], [["r", [], "", None, 0, 0]]):
        writer = FrameWriter(KEY)
        writer._packer = msgpack.Packer()  # same key and framing, wrong content
        with pytest.raises(PlaneError, match="not a list of token entries"):
            read_all(writer.frame(content), reader(KEY))


def test_a_well_signed_frame_that_does_not_decode_is_refused() -> None:
    writer = FrameWriter(KEY)
    writer._packer = type("Raw", (), {"pack": staticmethod(lambda _: b"\xc1")})()  # type: ignore[assignment]
    with pytest.raises(PlaneError, match="does not decode"):
        read_all(writer.frame(None), reader(KEY))


def test_logprobs_survive_the_wire() -> None:
    logprobs = [TokenLogprobs(5, -0.25, [(5, -0.25), (9, -1.5)]), TokenLogprobs(6, -2.0, [])]
    raw = msgpack.unpackb(msgpack.packb(encode_logprobs(logprobs)))
    assert decode_logprobs(raw) == logprobs
    assert encode_logprobs([]) is None and decode_logprobs(None) == []


def handshake(ingress_token: str, decode_token: str) -> tuple[object, object]:
    """Both ends of the handshake over a real loopback connection: each side's key or
    exception."""
    async def run() -> tuple[object, object]:
        result: dict[str, object] = {}

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                result["ingress"] = await TOKEN_PLANE.accept(reader, writer, ingress_token)
            except Exception as exc:  # noqa: BLE001 - recorded for the assertion
                result["ingress"] = exc
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            decode_side: object = await TOKEN_PLANE.connect(reader, writer, decode_token)
        except Exception as exc:  # noqa: BLE001
            decode_side = exc
        writer.close()
        while "ingress" not in result:
            await asyncio.sleep(0.01)
        server.close()
        return result["ingress"], decode_side

    return asyncio.run(run())


def test_the_handshake_gives_both_sides_one_key() -> None:
    ingress_key, decode_key = handshake("cluster-token-0123456789", "cluster-token-0123456789")
    assert isinstance(ingress_key, bytes) and ingress_key == decode_key


def test_a_peer_without_the_token_is_refused_on_both_sides() -> None:
    ingress_side, decode_side = handshake("cluster-token-0123456789", "another-token-987654321")
    assert isinstance(ingress_side, PlaneAuthError)
    assert not isinstance(decode_side, bytes)  # the ingress closed instead of proving itself
