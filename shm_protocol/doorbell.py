"""The event ring's doorbell pipe (Welcome.doorbell == DOORBELL_PIPE).

Why a pipe of its own rather than EventsReady frames on the control socket: the reader's event
loop polls the pipe's read end directly, so a wake-up goes straight to draining the ring (no
frame to encode, send, receive and decode, no hop through a stream reader), and the reader may
leave the byte unread until after it has drained (the reset is off the latency path).

Trust: the daemon creates the pipe and keeps the write end; the client only ever receives the
read end. O_NONBLOCK is a flag of the open file description, and the two ends are separate
descriptions, so nothing the client does to its end can make the daemon's write block: a full
pipe (a client that never reads) means a doorbell is already pending (EAGAIN, ignored), a closed
read end means the client is gone (EPIPE; Python ignores SIGPIPE), and the session's socket EOF
does the cleanup. The byte's value means nothing; the ring's indices are validated as always.
"""

from __future__ import annotations

import contextlib
import os


class DoorbellPipe:
    """Daemon side. `read_fd` goes to the client with the Welcome and is then closed here."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.rung = 0  # doorbells that reached the pipe (stats and tests)

    def ring(self) -> bool:
        """Wake the reader; never blocks. False when the reader's end is gone."""
        try:
            os.write(self.write_fd, b"\x01")
        except BlockingIOError:
            return True  # the pipe is full: a doorbell is pending already
        except OSError:
            return False
        self.rung += 1
        return True

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.read_fd = self.write_fd = -1

    def close_read_end(self) -> None:
        """After the read end was sent to the client: ours would only keep the pipe open."""
        with contextlib.suppress(OSError):
            os.close(self.read_fd)
        self.read_fd = -1


def reset(fd: int) -> int:
    """Client side: consume every pending doorbell byte (non-blocking); returns how many."""
    n = 0
    while True:
        try:
            got = len(os.read(fd, 4096))
        except BlockingIOError:
            return n
        if not got:
            return n  # the daemon closed its end; the socket's EOF reports that
        n += got
