"""The bundle format: a directory with a versioned, typed manifest. `flared` imports this module.

Layout of a bundle directory:

    manifest.json          `Manifest` (msgspec JSON); `format_version` names the format
    config.json            the checkpoint's Transformers config (structural data only)
    weights/*.safetensors  weights in execution layout and execution dtype
    frontend/              tokenizer.json, tokenizer_config.json (chat template inside)
    compile_cache/         Inductor caches written by prep, reused at load

Compatibility rule: a reader accepts every format version in SUPPORTED_FORMAT_VERSIONS and
refuses any other with a message naming it. New fields go last with defaults, so they need no
new version: an older reader ignores them (msgspec skips unknown fields) and a newer reader
fills their defaults for older bundles. Format 1 gained `Manifest.source` this way.
"""

from __future__ import annotations

import enum
from pathlib import Path

import msgspec

FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = (1,)
MANIFEST_NAME = "manifest.json"
_STATE_DTYPE_BYTES = {"float32": 4, "int64": 8}  # "execution" is the manifest's dtype


class BundleError(Exception):
    """A bundle cannot be read: missing, corrupt or of an unsupported format version."""


class ReasoningParser(enum.Enum):
    NONE = "none"
    THINK_TAGS = "think_tags"  # <think>...</think>


class ToolParser(enum.Enum):
    NONE = "none"
    HERMES_JSON = "hermes_json"  # <tool_call>{"name":..,"arguments":..}</tool_call>
    QWEN_XML = "qwen_xml"  # <tool_call><function=name><parameter=k>v</parameter>...


class Range(msgspec.Struct, frozen=True):
    """Inclusive bounds; request values outside clamp to the nearest endpoint."""

    low: float
    high: float


class SamplingDefaults(msgspec.Struct, frozen=True):
    """Declared by the recipe from the model card, never read from generation_config.json."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    temperature_range: Range | None = None
    top_p_range: Range | None = None


class StateTensor(msgspec.Struct, frozen=True):
    """One per-request recurrent-state tensor of one layer, declared by the recipe.

    The state pool stores it as [rows, *shape] (see prep.components.state_pool for the row
    regions). `dtype` is "float32", "int64" or "execution" (the manifest's execution dtype);
    an initialised row holds `fill` everywhere.
    """

    layer: int  # Transformers layer_idx owning the tensor
    name: str  # its role inside the layer, e.g. "recurrent", "conv"
    shape: list[int]
    dtype: str = "float32"
    fill: float = 0.0


class Geometry(msgspec.Struct, frozen=True):
    """Declared storage geometry: everything shared code needs to size and address state."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    attention_layers: list[int]  # Transformers layer_idx of every paged-attention layer
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sliding_window: int | None = None
    # per-row recurrent state of linear-attention layers (empty: a pure attention model)
    state_tensors: list[StateTensor] = msgspec.field(default_factory=list)

    def state_row_bytes(self, execution_dtype_bytes: int) -> int:
        """Bytes of one state-pool row over every declared tensor (the memory planner's unit)."""
        total = 0
        for s in self.state_tensors:
            n = 1
            for d in s.shape:
                n *= d
            total += n * _STATE_DTYPE_BYTES.get(s.dtype, execution_dtype_bytes)
        return total


class Catalog(msgspec.Struct, frozen=True):
    """The prepared executions: every capacity here gets an execution (and a CUDA graph)."""

    decode_capacities: list[int]
    prefill_capacities: list[int]
    max_prefill_chunk_tokens: int
    max_context_tokens: int
    max_top_logprobs: int = 20
    max_stop_token_ids: int = 8


class Frontend(msgspec.Struct, frozen=True):
    tokenizer_file: str
    tokenizer_config_file: str
    chat_template: str | None
    eos_token_ids: list[int]
    reasoning_parser: ReasoningParser = ReasoningParser.NONE
    tool_parser: ToolParser = ToolParser.NONE


class TensorEntry(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    shape: list[int]
    file: str


class CompileInfo(msgspec.Struct, frozen=True):
    enabled: bool
    cache_dir: str  # relative to the bundle
    torch_version: str
    device_kind: str  # "cpu" or "cuda"
    mode: str = "decode-forward"  # see prep.compiling.FORWARD_MODES


class Layout(msgspec.Struct, frozen=True):
    """Execution layout of the weights, declared by the recipe. Stored tensors keep their
    checkpoint names either way; a fused projection is loaded by row ranges (prep.components.fused)."""

    fused_qkv: bool = False  # q/k/v projections of each attention block as one weight
    fused_gate_up: bool = False  # gate/up projections of each MLP as one weight
    fused_gdn_in: bool = False  # input projections of each Gated DeltaNet layer as one weight


class NotLoaded(msgspec.Struct, frozen=True):
    """Checkpoint tensors deliberately left out of the bundle, all for one reason."""

    reason: str  # e.g. "vision encoder: image and video inputs are not served yet"
    tensors: list[str]  # their names in the checkpoint
    source_bytes: int  # their size in the checkpoint


class SourceAccount(msgspec.Struct, frozen=True):
    """How every tensor of the source checkpoint was used.

    Invariant: num_stored + num_stacked + the names in `not_loaded` == num_tensors; nothing is
    dropped without its reason listed here (a tied duplicate's reason names what it is tied to)."""

    architecture: (
        str  # as the checkpoint declares it; `Manifest.architecture` is the model prepared
    )
    num_tensors: int
    num_stored: int  # stored whole under their model names
    num_stacked: int  # written into their slice of a stacked parameter (one tensor per expert)
    not_loaded: list[NotLoaded] = msgspec.field(default_factory=list)


class Manifest(msgspec.Struct, frozen=True):
    format_version: int
    flare_version: str
    created_utc: str
    architecture: str  # Transformers architecture class name; selects the recipe
    model_type: str
    dtype: str  # execution dtype of weights and activations
    kv_dtype: str
    checkpoint_fingerprint: str  # sha256 over config + tensor headers of the source
    geometry: Geometry
    catalog: Catalog
    sampling_defaults: SamplingDefaults
    frontend: Frontend
    tensors: list[TensorEntry]
    tied_parameters: list[list[str]]  # groups of parameter names sharing one stored tensor
    compile: CompileInfo
    weight_bytes: int = 0
    layout: Layout = Layout()
    source: SourceAccount | None = None  # None: a bundle prepared before it was recorded


def write_manifest(bundle_dir: Path, manifest: Manifest) -> None:
    data = msgspec.json.format(msgspec.json.encode(manifest), indent=2)
    tmp = bundle_dir / (MANIFEST_NAME + ".tmp")
    tmp.write_bytes(data + b"\n")
    tmp.replace(bundle_dir / MANIFEST_NAME)


def read_manifest(bundle_dir: Path | str) -> Manifest:
    path = Path(bundle_dir) / MANIFEST_NAME
    if not path.is_file():
        raise BundleError(f"{bundle_dir} is not a Flare bundle: {MANIFEST_NAME} is missing")
    raw = path.read_bytes()
    try:
        head = msgspec.json.decode(raw, type=dict)
    except msgspec.DecodeError as exc:
        raise BundleError(f"{path}: not valid JSON ({exc})") from exc
    version = head.get("format_version")
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise BundleError(
            f"{path}: bundle format version {version!r} is not supported by this Flare "
            f"(supported: {', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))})"
        )
    try:
        return msgspec.json.decode(raw, type=Manifest)
    except msgspec.ValidationError as exc:
        raise BundleError(f"{path}: invalid manifest: {exc}") from exc
