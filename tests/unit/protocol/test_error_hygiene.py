"""What clients read of internal failures: typed rejections keep their message, anything else
becomes its kind plus a reference into the daemon's log, and filesystem paths never leave."""

from __future__ import annotations

import logging

from flared.engine.errors import CapacityError, InvalidRequest
from flared.server.admission import error_code, error_text
from shm_protocol import messages as m
from shm_protocol.redact import redact


def test_paths_are_redacted_and_the_rest_kept() -> None:
    text = "cannot map /dev/shm/flare-s1-77-events (from /opt/lib/libcuda.so.1): EBADF"
    assert redact(text) == "cannot map <path> (from <path>): EBADF"
    for kept in ("request_id must be 1..256 printable characters", "3/4 of the pages",
                 "see http://example.invalid/x", "a/b relative", "say /no_think",
                 "POST /v1 only"):  # fmt: skip
        assert redact(kept) == kept


def test_typed_rejections_keep_their_message() -> None:
    assert error_text(InvalidRequest("max_tokens must be >= 1")) == "max_tokens must be >= 1"
    quoted = 'invalid regex "^/api/v1/[a-z]+$" at #/properties/x'  # the client's own input
    assert error_text(InvalidRequest(quoted)) == quoted
    exc = CapacityError("prompt of 900 tokens exceeds the context limit 512")
    assert error_code(exc) == m.CAPACITY and error_text(exc) == str(exc)


def test_unexpected_errors_are_a_reference_into_the_log(caplog) -> None:
    exc = FileNotFoundError(2, "No such file", "/var/lib/flare/secret/weights.safetensors")
    with caplog.at_level(logging.ERROR, logger="flared.server"):
        text = error_text(exc)
    assert error_code(exc) == m.ENGINE_ERROR
    assert "FileNotFoundError" in text and "/var/lib" not in text and "secret" not in text
    ref = text[text.index("[") + 1 : text.index("]")]
    assert f"[{ref}]" in caplog.text and "/var/lib/flare/secret" in caplog.text  # operators see it
    assert error_text(RuntimeError("x")) != error_text(RuntimeError("x"))  # a fresh reference each
