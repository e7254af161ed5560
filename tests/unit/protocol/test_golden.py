"""Golden encoded bytes for every wire message. A failure here means the wire format changed:
tags and field order are released contract (STYLE.md rule 4); add fields last, with defaults.

msgspec writes every field of an array_like Struct (defaults included), so a message that
gained fields encodes longer; LEGACY keeps the bytes of the earlier layout, which must still
decode to the same message (missing tail fields take their defaults)."""

from __future__ import annotations

import typing

import msgspec
import pytest

from shm_protocol import messages as m
from shm_protocol.codec import (
    ProtocolViolation,
    client_decoder,
    daemon_decoder,
    encode_body,
    ring_event_decoder,
)
from shm_protocol.outbox import Outbox
from shm_protocol.ring import RingReader, RingWriter, init_header

SAMPLES: dict[str, msgspec.Struct] = {
    "OpenSession": m.OpenSession(1, "cli", "ring"),
    "OpenSession_pipe": m.OpenSession(1, "cli", "ring", m.DOORBELL_PIPE),
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
    "Welcome_pipe": m.Welcome(
        1, "s1", "ready", 1048576, 65536, 65536, 512, 512, [2], m.DOORBELL_PIPE
    ),
    "TokenDelta": m.TokenDelta("r1", [5, 6], "ab", [-0.5, -1.25], [[(5, -0.5)], [(6, -1.25)]]),
    "Finished": m.Finished("r1", "length", 3, 2, 0, "c"),
    "ErrorReply": m.ErrorReply("busy", "queue full", "r1"),
    "StatsReply": m.StatsReply(3, "ready", {"pages_free": 4}),
    "RenderResult": m.RenderResult(4, [1, 2], [2], "x"),
    "Pong": m.Pong(5, "ready"),
    "EventsReady": m.EventsReady(128, True),
    "Submit_chat": m.Submit(
        "r3",
        32,
        messages=[{"role": "user", "content": "hi"}],
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice={"type": "function", "function": {"name": "f"}},
        response_format={"type": "json_object"},
        stop=["END"],
        chat_template_kwargs={"enable_thinking": False},
        continue_final_message=False,
    ),
    "Submit_text": m.Submit("r4", 4, prompt_text="Once upon", stop=["\n"]),
    "Submit_ends": m.Submit("r5", 4, prompt_token_ids=[5, 6, 7, 8, 9], message_ends=[2, 4]),
    "Render_kwargs": m.Render(
        6, [{"role": "user", "content": "hi"}], [], True, {"enable_thinking": True}, False, "none"
    ),
    "TokenDelta_first": m.TokenDelta("r1", [5], "a", prompt_tokens=12),
    "TokenDelta_parsed": m.TokenDelta(
        "r3",
        [9],
        "<",
        content="a",
        reasoning="b",
        tool_calls=[m.ToolCallPart(0, "", "call_x0", "f"), m.ToolCallPart(0, "{}")],
    ),
    "Finished_parsed": m.Finished(
        "r3",
        "tool_calls",
        5,
        4,
        0,
        "",
        "c",
        "r",
        [m.ToolCallPart(1, "{}", "call_x1", "g")],
        "END",
        ["malformed tool call (kept as content): x"],
        True,
    ),
    "ErrorReply_tool_choice": m.ErrorReply(m.TOOL_CHOICE_UNSATISFIED, "no call", "r3"),
}

# Bytes of messages as encoded before they gained their trailing fields.
LEGACY = {
    "OpenSession": bytes.fromhex("940101a3636c69a472696e67"),
    "Welcome": bytes.fromhex(
        "9a4001a27331a57265616479ce00100000ce00010000ce00010000cd0200cd02009102"
    ),
    "Submit": bytes.fromhex(
        "9d02a27231089301020300909098cb3fe0000000000000c0c0c0c0c0c007029000c3c3"
    ),
    "Submit_messages": bytes.fromhex(
        "9d02a272321090009182a4726f6c65a475736572a7636f6e74656e74a2686990c0009000c2c3"
    ),
    # before message_ends (20 fields): an older client's submit still decodes
    "Submit_chat": bytes.fromhex(
        "dc001402a272332090009182a4726f6c65a475736572a7636f6e74656e74a268699182a474797065"
        "a866756e6374696f6ea866756e6374696f6e81a46e616d65a166c0009000c2c382a474797065a866"
        "756e6374696f6ea866756e6374696f6e81a46e616d65a16681a474797065ab6a736f6e5f6f626a65"
        "637491a3454e4481af656e61626c655f7468696e6b696e67c2a0c3c2"
    ),
    "Render": bytes.fromhex("9505049182a4726f6c65a475736572a7636f6e74656e74a2686990c3"),
    "TokenDelta": bytes.fromhex(
        "9641a27231920506a2616292cbbfe0000000000000cbbff400000000000092919205cbbfe0000000000000919206cbbff4000000000000"
    ),
    "Finished": bytes.fromhex("9742a27231a66c656e677468030200a163"),
}

GOLDEN = {
    "OpenSession": bytes.fromhex("950101a3636c69a472696e67a0"),
    "OpenSession_pipe": bytes.fromhex("950101a3636c69a472696e67a470697065"),
    "Submit": bytes.fromhex(
        "dc001502a27231089301020300909098cb3fe0000000000000c0c0c0c0c0c007029000c3c3a46175"
        "746fc09080a0c3c290"
    ),
    "Submit_messages": bytes.fromhex(
        "dc001502a272321090009182a4726f6c65a475736572a7636f6e74656e74a2686990c0009000c2c3"
        "a46175746fc09080a0c3c290"
    ),
    "Submit_ends": bytes.fromhex(
        "dc001502a2723504950506070809009090c0009000c2c3a46175746fc09080a0c3c2920204"
    ),
    "Cancel": bytes.fromhex("9203a27231"),
    "GetStats": bytes.fromhex("920403"),
    "Render": bytes.fromhex(
        "9805049182a4726f6c65a475736572a7636f6e74656e74a2686990c380c2a46175746f"
    ),
    "Ping": bytes.fromhex("920605"),
    "Advance": bytes.fromhex("9107"),
    "Welcome": bytes.fromhex(
        "9b4001a27331a57265616479ce00100000ce00010000ce00010000cd0200cd02009102a0"
    ),
    "Welcome_pipe": bytes.fromhex(
        "9b4001a27331a57265616479ce00100000ce00010000ce00010000cd0200cd02009102a470697065"
    ),
    "TokenDelta": bytes.fromhex(
        "9a41a27231920506a2616292cbbfe0000000000000cbbff400000000000092919205cbbfe0000000"
        "000000919206cbbff4000000000000a0a09000"
    ),
    "TokenDelta_first": bytes.fromhex("9a41a272319105a1619090a0a0900c"),
    "Finished": bytes.fromhex("9d42a27231a66c656e677468030200a163a0a090a090c2"),
    "ErrorReply": bytes.fromhex("9543a462757379aa71756575652066756c6ca2723100"),
    "StatsReply": bytes.fromhex("944403a5726561647981aa70616765735f6672656504"),
    "RenderResult": bytes.fromhex("9545049201029102a178"),
    "Pong": bytes.fromhex("934605a57265616479"),
    "EventsReady": bytes.fromhex("9347cc80c3"),
    "Submit_chat": bytes.fromhex(
        "dc001502a272332090009182a4726f6c65a475736572a7636f6e74656e74a268699182a474797065"
        "a866756e6374696f6ea866756e6374696f6e81a46e616d65a166c0009000c2c382a474797065a866"
        "756e6374696f6ea866756e6374696f6e81a46e616d65a16681a474797065ab6a736f6e5f6f626a65"
        "637491a3454e4481af656e61626c655f7468696e6b696e67c2a0c3c290"
    ),
    "Submit_text": bytes.fromhex(
        "dc001502a272340490009090c0009000c2c3a46175746fc091a10a80a94f6e63652075706f6ec3c290"
    ),
    "Render_kwargs": bytes.fromhex(
        "9805069182a4726f6c65a475736572a7636f6e74656e74a2686990c381af656e61626c655f746869"
        "6e6b696e67c3c2a46e6f6e65"
    ),
    "TokenDelta_parsed": bytes.fromhex(
        "9a41a272339109a13c9090a161a162929400a0a763616c6c5f7830a1669400a27b7da0a000"
    ),
    "Finished_parsed": bytes.fromhex(
        "9d42a27233aa746f6f6c5f63616c6c73050400a0a163a172919401a27b7da763616c6c5f7831a167"
        "a3454e4491d9286d616c666f726d656420746f6f6c2063616c6c20286b65707420617320636f6e74"
        "656e74293a2078c3"
    ),
    "ErrorReply_tool_choice": bytes.fromhex(
        "9543b7746f6f6c5f63686f6963655f756e736174697366696564a76e6f2063616c6ca2723300"
    ),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_golden_bytes(name: str) -> None:
    msg = SAMPLES[name]
    assert encode_body(msg) == GOLDEN[name]
    decoder = client_decoder() if type(msg).__struct_config__.tag < 64 else daemon_decoder()
    assert decoder.decode(GOLDEN[name]) == msg


@pytest.mark.parametrize("name", sorted(LEGACY))
def test_legacy_bytes_still_decode(name: str) -> None:
    msg = SAMPLES[name]
    decoder = client_decoder() if type(msg).__struct_config__.tag < 64 else daemon_decoder()
    assert decoder.decode(LEGACY[name]) == msg


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


def test_event_ring_record_is_an_array_of_golden_events() -> None:
    """Protocol 2's event-ring record: a msgpack array header, then the events' own golden
    bytes back to back (what Outbox(batch=True) writes for one flush)."""
    names = ["TokenDelta", "Finished", "ErrorReply"]
    record = b"\x93" + b"".join(GOLDEN[n] for n in names)
    buf = memoryview(bytearray(192 + 1024))
    init_header(buf, 1024)
    outbox = Outbox(RingWriter(buf, 1024))
    for n in names:
        outbox.enqueue("r1", encode_body(SAMPLES[n]), n != "TokenDelta")
    outbox.flush()
    (got,) = RingReader(buf, 1024).drain()
    assert bytes(got) == record
    assert ring_event_decoder().decode(record) == [SAMPLES[n] for n in names]


@pytest.mark.parametrize(
    "record",
    [
        GOLDEN["TokenDelta"],  # one event, not an array of them
        b"\x91" + GOLDEN["Welcome"],  # a daemon message that never travels in the ring
        b"\x91" + GOLDEN["Cancel"],  # a client message
        b"\x92" + GOLDEN["Finished"],  # an array shorter than its header says
        b"\x91\xc1",  # garbage
    ],
)
def test_event_ring_decoder_refuses_anything_else(record: bytes) -> None:
    with pytest.raises(ProtocolViolation):
        ring_event_decoder().decode(record)
