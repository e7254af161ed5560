LAYOUT: tuple[int, int, int, int, int, int, int, int]

def publish_one(
    data: memoryview,
    words: memoryview,
    payload: bytes,
    head: int,
    published: int,
    tail: int,
    sleeps_seen: int | None,
    max_payload: int,
) -> tuple[int, int, int, int | None]: ...
