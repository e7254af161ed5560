"""Flare's one compiled part: the event ring's per-step publish (shm_protocol/_ringfast.c).

Optional: where it cannot be built (no C compiler or no Python headers), installation goes on
and the ring publishes through its pure-Python path (the same bytes, slower per call)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shm_protocol._ringfast",
            ["shm_protocol/_ringfast.c"],
            extra_compile_args=["-std=gnu11"],
            optional=True,
        )
    ]
)
