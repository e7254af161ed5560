"""Request validation: public sampling parameters -> the scheduler's RequestParams. Pure CPU.

Unspecified (None) values take the bundle's declared sampling defaults. Values outside a
declared inclusive range clamp to its nearest endpoint; values outside the mathematically valid
domain are rejected with InvalidRequest naming the parameter. Temperature must be > 0: greedy
decoding is not a sampling mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flared.engine.errors import InvalidRequest
from flared.engine.plan import RequestParams
from prep.bundle import Range, SamplingDefaults

MAX_SEED = (1 << 64) - 1
PENALTY_LIMIT = 2.0


MIN_TEMPERATURE = 1e-6  # smallest temperature sampled; positive values below it clamp up
MIN_REPETITION_PENALTY = 1e-6  # the same for the repetition penalty (a divisor of logits too)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None


def _clamp(value: float, rng: Range | None) -> float:
    if rng is None:
        return value
    return min(max(value, rng.low), rng.high)


def _finite(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value!r}")
    return float(value)


def resolve_params(
    sp: SamplingParams,
    defaults: SamplingDefaults,
    *,
    max_tokens: int,
    logprobs: int,
    stop_token_ids: tuple[int, ...],
    min_tokens: int,
    ignore_eos: bool,
    max_top_logprobs: int,
    max_stop_token_ids: int,
    vocab_size: int,
    random_seed: int | None = None,
    constrained: bool = False,
) -> RequestParams:
    def pick(name: str) -> float:
        v = getattr(sp, name)
        return _finite(name, getattr(defaults, name) if v is None else v)

    temperature = pick("temperature")
    if temperature <= 0:
        raise InvalidRequest(
            f"temperature must be > 0 (got {temperature}); greedy decoding is not supported"
        )
    temperature = _clamp(temperature, defaults.temperature_range)
    # The device divides fp32 logits by it: a positive value that is 0 (or denormal) in fp32
    # would turn every probability into NaN, so tiny temperatures sample at MIN_TEMPERATURE.
    temperature = max(temperature, MIN_TEMPERATURE)
    top_p = pick("top_p")
    if not 0 < top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    top_p = _clamp(top_p, defaults.top_p_range)
    min_p = pick("min_p")
    if not 0 <= min_p <= 1:
        raise InvalidRequest(f"min_p must be in [0, 1], got {min_p}")
    top_k_raw = defaults.top_k if sp.top_k is None else sp.top_k
    if not isinstance(top_k_raw, int) or isinstance(top_k_raw, bool):
        raise InvalidRequest(f"top_k must be an integer, got {top_k_raw!r}")
    top_k = 0 if top_k_raw in (-1, 0) else top_k_raw  # -1 and 0 both disable top-k
    if top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0 (0 or -1 disables it), got {top_k_raw}")
    rep = pick("repetition_penalty")
    if rep <= 0:
        raise InvalidRequest(f"repetition_penalty must be > 0, got {rep}")
    rep = max(rep, MIN_REPETITION_PENALTY)  # as temperature: fp32 zero would make NaN logits
    pres, freq = pick("presence_penalty"), pick("frequency_penalty")
    for name, v in (("presence_penalty", pres), ("frequency_penalty", freq)):
        if not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:
            raise InvalidRequest(f"{name} must be in [-2, 2], got {v}")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if not isinstance(min_tokens, int) or min_tokens < 0 or min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens must be in [0, max_tokens], got {min_tokens!r}")
    if not isinstance(logprobs, int) or not 0 <= logprobs <= max_top_logprobs:
        raise InvalidRequest(f"logprobs must be in [0, {max_top_logprobs}], got {logprobs!r}")
    if len(stop_token_ids) > max_stop_token_ids:
        raise InvalidRequest(
            f"at most {max_stop_token_ids} stop token ids are supported, got {len(stop_token_ids)}"
        )
    for t in stop_token_ids:
        if not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidRequest(f"stop token id {t!r} is outside the vocabulary")
    seed = sp.seed
    if seed is None:
        import secrets

        seed = random_seed if random_seed is not None else secrets.randbits(63)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise InvalidRequest(f"seed must be an integer in [0, 2^64), got {seed!r}")
    return RequestParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=rep,
        presence_penalty=pres,
        frequency_penalty=freq,
        seed=seed,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=bool(ignore_eos),
        stop_token_ids=tuple(stop_token_ids),
        logprobs=logprobs,
        constrained=constrained,
        # a seed of its own (or one possible token) promises the same tokens alone and batched
        reproducible=sp.seed is not None or top_k == 1,
    )
