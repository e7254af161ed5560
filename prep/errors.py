"""Typed preparation failures; `flare prep` prints them and exits non-zero."""


class PrepError(Exception):
    """Preparation cannot continue; the message names what is unsupported or wrong."""


class UnsupportedModel(PrepError):
    """The architecture, dtype, attention variant or a tensor is not supported by any recipe."""


class InvalidCapacity(PrepError):
    """A requested capacity (context, chunk, decode batch) cannot be prepared."""
