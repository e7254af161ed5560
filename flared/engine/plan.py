"""The two typed objects that cross the scheduler/runner boundary, one each way.

Scheduler -> runner: a `StepPlan` (what to run, which rows and pages).
Runner -> scheduler: a `StepResult` (sampled tokens and completion flags, per row).

The runner never mutates a request; the scheduler never sees a tensor. Everything here is
plain Python data (ints, floats, tuples) so that the scheduler is testable without torch.

Region map of the request-row space (rows index the runner's persistent request state):

    row 0                      NULL_ROW: padding rows of a decode batch point here; the
                               prepared executions never mutate it.
    rows 1 .. max_num_rows     live request rows, one per running request.

Region map of the KV page space (page ids index every attention layer's page storage):

    pages 0 .. num_pages-1     allocatable pages, shared by every attention layer. A page
                               is private to one live request, or an immutable complete page
                               shared by checkpoints and requests, or the partial tail page
                               owned by one snapshot.
    page  num_pages            the trash page: slot-mapping entries equal to PAD_SLOT are
                               redirected there by the prepared executions, so padding never
                               writes another request's pages.

Snapshot ids 0 .. num_snapshot_rows-1 name the runner's immutable snapshot rows (the runner maps
snapshot i to its own state row, e.g. 1 + max_num_rows + i). A snapshot row holds the complete
continuation state of a checkpoint except its KV pages: recurrent matrices and convolution
histories, position metadata, the consumed count and the saved final hidden vector.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

NULL_ROW = 0
PAD_SLOT = -1
NO_PAGE = -1  # an unused page-table entry


class FinishReason(IntEnum):
    """Why a request stopped. The integer codes are written by the prepared executions."""

    NONE = 0
    EOS = 1  # an EOS token id of the model was sampled
    STOP_TOKEN = 2  # one of the request's stop token ids was sampled
    LENGTH = 3  # max_tokens generated
    CANCELLED = 4
    CAPACITY = 5  # the context limit was reached
    ERROR = 6  # the engine failed (the host's verdict; no execution writes it)


@dataclass(frozen=True)
class RequestParams:
    """Everything the device request state needs at admission. Validated before it gets here."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # 1.0 = disabled
    min_p: float = 0.0  # 0.0 = disabled
    repetition_penalty: float = 1.0  # 1.0 = neutral
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0  # number of top alternatives per generated token; 0 = none
    # grammar-constrained: each sample needs a host-built mask from the previous token, so
    # the request is never planned while a step that references it is in flight
    constrained: bool = False
    # the client asked for a reproducible draw (a seed of its own, or top_k = 1): every decode
    # step of the request runs the batch-invariant products, so its tokens are the same alone
    # and beside others. False (no seed: the engine drew one) lets a step that runs this
    # request alone take the runner's faster one-row products (`decode_single_gemm`).
    reproducible: bool = True


@dataclass(frozen=True)
class AdmitOp:
    """Initialise a live request row: parameters, RNG, counters, penalty histogram.

    `prompt_token_ids` is the whole prompt; the histogram is built from it exactly once here.
    """

    request_id: str
    row: int
    prompt_token_ids: tuple[int, ...]
    params: RequestParams
    # the same ids as little-endian int64s when the submitter packed them (checking the prompt
    # does), so that staging is one copy instead of a conversion per token
    prompt_packed: bytes | None = None


@dataclass(frozen=True)
class PrefillOp:
    """One bounded chunk of one request's prompt.

    Invariant: start_pos + len(token_ids) <= len(prompt); slot_mapping[i] is the physical KV slot
    (page_id * page_size + offset) of position start_pos + i. When `sample` is true this chunk
    ends the prompt and the execution samples the first output token into the row's pending slot.
    """

    request_id: str
    row: int
    token_ids: tuple[int, ...]
    start_pos: int
    slot_mapping: tuple[int, ...]
    sample: bool


@dataclass(frozen=True)
class DecodeOp:
    """One decode step over running rows: each consumes its device-resident pending token.

    The runner pads `rows` with NULL_ROW up to the smallest prepared capacity that fits.
    Positions and KV slots come from the device request state and the resident page tables.
    """

    rows: tuple[int, ...]
    request_ids: tuple[str, ...]


class PageTableWrite(NamedTuple):
    """Set page_table[row][index] = page_id in the resident page tables (NO_PAGE clears).
    A named tuple: an admission of a long prompt makes one per page, so they must be cheap."""

    row: int
    index: int  # type: ignore[assignment]  # the field shadows tuple.index, deliberately
    page_id: int


class PageTableWrites:
    """Page-table writes as three equal-length columns (what the scheduler hands the runner: a
    long admission or a release writes one entry per page, and columns cost no object per
    entry). Iterates as PageTableWrite, in column order."""

    __slots__ = ("index", "pages", "rows")

    def __init__(
        self, rows: tuple[int, ...], index: tuple[int, ...], pages: tuple[int, ...]
    ) -> None:
        if not len(rows) == len(index) == len(pages):
            raise ValueError("page-table write columns differ in length")
        self.rows = rows
        self.index = index
        self.pages = pages

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[PageTableWrite]:
        return map(PageTableWrite._make, zip(self.rows, self.index, self.pages))

    def __repr__(self) -> str:
        return f"PageTableWrites({len(self)} entries)"


def write_columns(
    writes: PageTableWrites | tuple[PageTableWrite, ...],
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(rows, index, pages) columns of either form of a step's page-table writes."""
    if isinstance(writes, PageTableWrites):
        return writes.rows, writes.index, writes.pages
    if not writes:
        return (), (), ()
    rows, index, pages = zip(*writes, strict=True)
    return rows, index, pages


@dataclass(frozen=True)
class PageCopy:
    """Copy every slot of KV page `src_page` to page `dst_page`, in every attention layer."""

    src_page: int
    dst_page: int


@dataclass(frozen=True)
class RestoreOp:
    """Restore checkpoint state into a live row that its AdmitOp initialised in this step.

    Copy snapshot row `snapshot` into live row `row` (recurrent state, convolution histories,
    position metadata, saved final hidden vector) and set the row's consumed count to
    `num_tokens`; then apply `tail_copy` (the checkpoint's partial tail page into the row's
    private page for positions num_tokens // P * P ..), present iff num_tokens % P != 0. The
    request-state part of the row (parameters, RNG, counters, penalty histogram) stays as the
    AdmitOp set it. The complete pages below the tail are already in the row's page table.
    """

    request_id: str
    row: int
    snapshot: int
    num_tokens: int
    tail_copy: PageCopy | None = None


@dataclass(frozen=True)
class ResumeOp:
    """Sample each row's first output from its restored saved final hidden vector.

    For a full-prompt hit: the row consumed its whole prompt through a RestoreOp in this step.
    Vocabulary projection and sampling only, no forward pass; the sample is committed exactly
    like the sample of a final prefill chunk (pending token, counters, penalty histogram).
    """

    rows: tuple[int, ...]
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class SnapshotOp:
    """Copy live row `row` into snapshot row `snapshot`, after every other op of the step.

    The snapshot records exactly `num_tokens` consumed tokens (a sampled pending token is not
    part of it). The row has consumed exactly that many, except for a checkpoint inside a chunk
    of a model without recurrent state: then the row consumed more in this step, and the saved
    hidden vector that comes along belongs to a later token (the scheduler never samples from
    it). `tail_copy` copies the row's partial page (positions
    num_tokens // P * P ..) into the page the snapshot owns; None when num_tokens % P == 0 or
    when the request hands its own tail page to the snapshot (it leaves the row in this step).
    The snapshot's pages and row are immutable from the end of this step on.
    """

    request_id: str
    row: int
    snapshot: int
    num_tokens: int
    tail_copy: PageCopy | None = None


@dataclass(frozen=True)
class StepPlan:
    """One engine step. Executed in this order: page-table writes, admits, restores, resume,
    decode, prefill, snapshots (see the field comments); steps execute in step_id order."""

    step_id: int
    page_table_writes: PageTableWrites | tuple[PageTableWrite, ...] = ()
    admits: tuple[AdmitOp, ...] = ()
    decode: DecodeOp | None = None
    prefill: PrefillOp | None = None
    # True when the step's inputs depend on no result that is still in flight.
    host_dependency: bool = False
    # After admits: restore checkpoint state into freshly admitted rows (prefix hits).
    restores: tuple[RestoreOp, ...] = ()
    # After restores, before decode: first samples of full-prompt hits.
    resume: ResumeOp | None = None
    # Last: checkpoint captures at exact consumed counts.
    snapshots: tuple[SnapshotOp, ...] = ()
    # Rows whose requests released them since the previous plan (a leaving row's terminal
    # snapshot above still reads it). Nothing is executed for them: their page-table entries
    # stay on the device, stale, until the row's next admission rewrites what changes.
    released_rows: tuple[int, ...] = ()

    @property
    def is_empty(self) -> bool:
        return (
            not self.admits
            and self.decode is None
            and self.prefill is None
            and not self.restores
            and self.resume is None
            and not self.snapshots
        )


@dataclass(frozen=True)
class SampledToken:
    """One row's output of one step, as the device wrote it."""

    request_id: str
    row: int
    token_id: int
    valid: bool  # False: the row was already finished on the device; nothing was generated
    finish_reason: FinishReason
    logprob: float = 0.0
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StepResult:
    step_id: int
    decoded: tuple[SampledToken, ...] = ()
    prefilled: SampledToken | None = None  # set only when the prefill op sampled
    error: str | None = None
    extra: dict[str, float] = field(default_factory=dict)
    resumed: tuple[SampledToken, ...] = ()  # one per ResumeOp row, in any order
