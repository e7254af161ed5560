"""The scheduler's frozen configuration and the submission checks that depend only on it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from flared.engine.errors import CapacityError, InvalidRequest
from flared.engine.plan import RequestParams


@dataclass(frozen=True)
class SchedulerConfig:
    num_pages: int
    page_size: int  # tokens per KV page
    max_num_rows: int
    decode_capacities: tuple[int, ...]  # prepared decode batch sizes, ascending
    max_prefill_chunk_tokens: int
    max_context_tokens: int  # bound on prompt + output tokens of one request
    max_num_waiting: int
    # Prefix cache: snapshot rows the runner holds for checkpoints (0 turns the cache off) and
    # the conditioning identity every prefix digest starts from.
    num_snapshot_rows: int = 0
    model_id: str = ""
    token_layout: str = ""
    # The model carries recurrent state (linear-attention layers): a checkpoint's state exists
    # only at the end of a chunk, so prefill chunks end at every captured endpoint. Without it
    # a checkpoint is its KV pages, which a longer chunk writes as well, so captures may fall
    # inside a chunk (one forward for a whole appended turn); such a checkpoint has no saved
    # final hidden vector and never serves a full-prompt hit.
    recurrent_state: bool = True
    # Message endpoints closer than this to the restored checkpoint or to the prompt's end are
    # not captured (capture.select_captures); the engine sets RECURRENT_MIN_CAPTURE_GAP for
    # recurrent models, where each capture costs a prefill execution of its own.
    min_capture_gap: int = 1
    # (capacity, device time) of each prepared prefill execution, as the runner measured them:
    # prefill segments are cut into the chunks of least total time (chunking.ChunkCosts).
    # Empty: every chunk is as long as the limit and the segment allow.
    prefill_chunk_costs: tuple[tuple[int, float], ...] = ()
    # (capacity, fewest tokens, ms) of each fresh prefill execution: what a chunk that starts
    # its prompt saves by taking it (chunking.ChunkCosts.first_chunk_of_prompt); with the costs
    prefill_fresh_bonus: tuple[tuple[int, int, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_num_rows", "max_prefill_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_context_tokens < 2:
            raise ValueError(
                f"max_context_tokens must be at least 2, got {self.max_context_tokens}"
            )
        if self.num_snapshot_rows < 0:
            raise ValueError(
                f"num_snapshot_rows must be non-negative, got {self.num_snapshot_rows}"
            )
        if self.max_num_waiting < 0:
            raise ValueError(f"max_num_waiting must be non-negative, got {self.max_num_waiting}")
        caps = self.decode_capacities
        if not caps or caps[0] < 1 or any(a >= b for a, b in pairwise(caps)):
            raise ValueError(f"decode_capacities must be positive and strictly ascending: {caps}")

    @property
    def max_decode_rows(self) -> int:
        return self.decode_capacities[-1]

    @property
    def max_pages_per_row(self) -> int:
        """Page-table width a row can need: the largest admission reservation (a prompt of
        max_context_tokens - 1 tokens); growth never needs more."""
        return self.admission_pages(self.max_context_tokens - 1)

    def admission_pages(self, prompt_len: int) -> int:
        """Pages reserved when admitting a prompt of `prompt_len` tokens: its pages plus one."""
        return -(-prompt_len // self.page_size) + 1


def check_prompt_fits(config: SchedulerConfig, prompt_len: int) -> None:
    """Raise CapacityError unless a prompt of this length could run in an otherwise idle engine."""
    if prompt_len + 1 > config.max_context_tokens:
        raise CapacityError(
            f"prompt of {prompt_len} tokens + 1 exceeds the context limit of "
            f"{config.max_context_tokens} tokens"
        )
    num_pages = config.admission_pages(prompt_len)
    if num_pages > config.num_pages:
        raise CapacityError(
            f"prompt of {prompt_len} tokens needs {num_pages - 1} pages + 1 for generation, "
            f"more than the pool of {config.num_pages} pages of {config.page_size} tokens"
        )


def check_submission(
    config: SchedulerConfig, prompt: Sequence[int], params: RequestParams, endpoints: Sequence[int]
) -> None:
    """Raise InvalidRequest or CapacityError for a request that must not be queued.

    Sampling value ranges are validated upstream; only what the scheduler relies on is checked.
    """
    if not prompt:
        raise InvalidRequest("prompt is empty")
    if params.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {params.max_tokens}")
    inside = all(0 < e < len(prompt) for e in endpoints)
    if not inside or any(a >= b for a, b in pairwise(endpoints)):
        raise InvalidRequest(
            f"endpoints must be strictly increasing offsets inside the prompt of "
            f"{len(prompt)} tokens, got {list(endpoints)}"
        )
    check_prompt_fits(config, len(prompt))
