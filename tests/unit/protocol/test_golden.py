"""Golden encoded bytes for every wire message. A failure here means the wire format changed:
tags and field order are released contract (STYLE.md rule 4); add fields last, with defaults."""

from __future__ import annotations

import typing

import msgspec
import pytest

from shm_protocol import messages as m
from shm_protocol.codec import client_decoder, daemon_decoder, encode_body

SAMPLES: dict[str, msgspec.Struct] = {
    "OpenSession": m.OpenSession(1, "cli", "ring"),
    "Submit": m.Submit(
        "r1",
        8,
        [1, 2, 3],
        sampling=m.WireSampling(temperature=0.5, seed=7),
        logprobs=2,
        ignore_eos=True,
    ),
    "Submit_messages": m.Submit("r2", messages=[{"role": "user", "content": "hi"}]),
    "Cancel": m.Cancel("r1"),
    "GetStats": m.GetStats(3),
    "Render": m.Render(4, [{"role": "user", "content": "hi"}]),
    "Ping": m.Ping(5),
    "Advance": m.Advance(),
    "Welcome": m.Welcome(1, "s1", "ready", 1048576, 65536, 65536, 512, 512, [2]),
    "TokenDelta": m.TokenDelta("r1", [5, 6], "ab", [-0.5, -1.25], [[(5, -0.5)], [(6, -1.25)]]),
    "Finished": m.Finished("r1", "length", 3, 2, 0, "c"),
    "ErrorReply": m.ErrorReply("busy", "queue full", "r1"),
    "StatsReply": m.StatsReply(3, "ready", {"pages_free": 4}),
    "RenderResult": m.RenderResult(4, [1, 2], [2], "x"),
    "Pong": m.Pong(5, "ready"),
    "EventsReady": m.EventsReady(128, True),
}

GOLDEN = {
    "OpenSession": bytes.fromhex("940101a3636c69a472696e67"),
    "Submit": bytes.fromhex(
        "9d02a27231089301020300909098cb3fe0000000000000c0c0c0c0c0c007029000c3c3"
    ),
    "Submit_messages": bytes.fromhex(
        "9d02a272321090009182a4726f6c65a475736572a7636f6e74656e74a2686990c0009000c2c3"
    ),
    "Cancel": bytes.fromhex("9203a27231"),
    "GetStats": bytes.fromhex("920403"),
    "Render": bytes.fromhex("9505049182a4726f6c65a475736572a7636f6e74656e74a2686990c3"),
    "Ping": bytes.fromhex("920605"),
    "Advance": bytes.fromhex("9107"),
    "Welcome": bytes.fromhex(
        "9a4001a27331a57265616479ce00100000ce00010000ce00010000cd0200cd02009102"
    ),
    "TokenDelta": bytes.fromhex(
        "9641a27231920506a2616292cbbfe0000000000000cbbff400000000000092919205cbbfe0000000000000919206cbbff4000000000000"
    ),
    "Finished": bytes.fromhex("9742a27231a66c656e677468030200a163"),
    "ErrorReply": bytes.fromhex("9543a462757379aa71756575652066756c6ca2723100"),
    "StatsReply": bytes.fromhex("944403a5726561647981aa70616765735f6672656504"),
    "RenderResult": bytes.fromhex("9545049201029102a178"),
    "Pong": bytes.fromhex("934605a57265616479"),
    "EventsReady": bytes.fromhex("9347cc80c3"),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_golden_bytes(name: str) -> None:
    msg = SAMPLES[name]
    assert encode_body(msg) == GOLDEN[name]
    decoder = client_decoder() if type(msg).__struct_config__.tag < 64 else daemon_decoder()
    assert decoder.decode(GOLDEN[name]) == msg


def test_every_message_has_a_golden_sample() -> None:
    union = typing.get_args(m.ClientMessage) + typing.get_args(m.DaemonMessage)
    assert {t.__name__ for t in union} == {k.split("_")[0] for k in SAMPLES}


def test_tags_are_unique_and_in_their_ranges() -> None:
    client = [t.__struct_config__.tag for t in typing.get_args(m.ClientMessage)]
    daemon = [t.__struct_config__.tag for t in typing.get_args(m.DaemonMessage)]
    assert len(set(client + daemon)) == len(client + daemon)
    assert all(1 <= t < 64 for t in client) and all(64 <= t < 128 for t in daemon)


def test_messages_are_frozen() -> None:
    with pytest.raises(AttributeError):
        m.Cancel("x").request_id = "y"  # type: ignore[misc]
