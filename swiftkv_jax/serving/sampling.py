"""Next-token choice: greedy, temperature, top-k, top-p (nucleus), min-p, from a seed; the range checks of the
penalties, the logit bias and min_tokens the continuous engine applies (`ragged_step.apply_penalties`,
`apply_bias`, `mask_stops`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from swiftkv_jax.checks import integer, real
from swiftkv_jax.serving.errors import InvalidRequest


TINY = float(jnp.finfo(jnp.float32).tiny)  # the smallest normal fp32 temperature
MAX_TEMPERATURE = float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0            # 0: off (as is any k >= the vocabulary: it keeps every token)
    top_p: float = 1.0        # 1: off
    min_p: float = 0.0        # 0: off; after the temperature, drop tokens less likely than min_p x the top one

    def __post_init__(self):
        # a NaN temperature sampled token 0 every step, a float top_k failed inside lax.top_k: refused by name, and
        # numpy scalars stored as Python numbers (the params are a static argument of the decode loop)
        object.__setattr__(self, "temperature", real("temperature", self.temperature, InvalidRequest))
        object.__setattr__(self, "top_k", integer("top_k", self.top_k, 0, InvalidRequest))
        object.__setattr__(self, "top_p", real("top_p", self.top_p, InvalidRequest))
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0 (0 = greedy), got {self.temperature}", "temperature")
        if self.temperature > MAX_TEMPERATURE:  # the step divides in fp32, where it would be inf
            raise InvalidRequest(f"temperature must be at most {MAX_TEMPERATURE:.4g} (fp32's largest number), got "
                                 f"{self.temperature:.4g}", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must lie in (0, 1] (1 = off), got {self.top_p}", "top_p")
        object.__setattr__(self, "min_p", real("min_p", self.min_p, InvalidRequest))
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must lie in [0, 1] (0 = off), got {self.min_p}", "min_p")


SEEDS = 2**31  # a request's seed lies in [0, SEEDS), as the server's clients send it (a 32-bit signed int)


def check_seed(seed) -> int:
    """A request's sampling seed as an int in [0, SEEDS); InvalidRequest naming it."""
    seed = integer("seed", seed, error=InvalidRequest)
    if not 0 <= seed < SEEDS:
        raise InvalidRequest(f"seed must lie in [0, 2**31), got {seed}", "seed")
    return seed


def check_stop_ids(ids, vocab_size: int) -> None:
    """Stop ids inside the vocabulary: one past it is never sampled, so a generation would never stop at it."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"stop_token_ids must lie in [0, {vocab_size}), got {bad[:5]}"
                             + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""), "stop_token_ids")


def check_penalties(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0) -> tuple:
    """(repetition, presence, frequency) as floats, vLLM's ranges: repetition_penalty > 0 (1 = off), presence and
    frequency in [-2, 2] (0 = off); InvalidRequest naming the first bad one."""
    repetition = real("repetition_penalty", repetition_penalty, InvalidRequest)
    if repetition <= 0:
        raise InvalidRequest(f"repetition_penalty must be > 0 (1 = off), got {repetition}", "repetition_penalty")
    out = [repetition]
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        value = real(name, value, InvalidRequest)
        if not -2 <= value <= 2:
            raise InvalidRequest(f"{name} must lie in [-2, 2] (0 = off), got {value}", name)
        out.append(value)
    return tuple(out)


MAX_LOGIT_BIAS = 300  # entries of a request's logit_bias, as the OpenAI API allows
MAX_MASKED_STOP_IDS = 128  # stop ids a request with min_tokens may have (the width of the engine's per-slot table)


def check_min_tokens(min_tokens, max_tokens: int) -> int:
    """vLLM's min_tokens (no stop before that many generated tokens) as an int in [0, max_tokens], with vLLM's
    messages; InvalidRequest naming it."""
    min_tokens = integer("min_tokens", min_tokens, error=InvalidRequest)
    if min_tokens < 0:
        raise InvalidRequest(f"min_tokens must be greater than or equal to 0, got {min_tokens}", "min_tokens")
    if min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}",
                             "min_tokens")
    return min_tokens


def check_logit_bias(logit_bias, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias {token id: bias} as ((id, bias), ...) sorted by id: ids integers in [0, vocab_size),
    biases finite in [-100, 100], at most MAX_LOGIT_BIAS of them (None or {}: none); InvalidRequest naming it."""
    if logit_bias is None:
        return ()
    if not isinstance(logit_bias, dict):
        raise InvalidRequest(f"logit_bias must be a dict of token id -> bias, got {logit_bias!r:.80}", "logit_bias")
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias takes at most {MAX_LOGIT_BIAS} token ids, got {len(logit_bias)}",
                             "logit_bias")
    out = {}
    for token, bias in logit_bias.items():
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
            raise InvalidRequest(f"logit_bias keys must be token ids (integers), got {token!r:.80}", "logit_bias")
        if not 0 <= token < vocab_size:
            raise InvalidRequest(f"logit_bias token ids must lie in [0, {vocab_size}), got {token}", "logit_bias")
        bias = real("logit_bias", bias, InvalidRequest)
        if not -100 <= bias <= 100:
            raise InvalidRequest(f"logit_bias values must lie in [-100, 100], got {bias} for token {token}",
                                 "logit_bias")
        out[int(token)] = bias
    return tuple(sorted(out.items()))


def sample(logits, rng, params: SamplingParams):
    """tokens [B] from fp32 logits [B, V]."""
    if params.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32)
    # less the row's max first (softmax is unchanged): at a tiny temperature the quotient overflowed to inf, softmax
    # gave NaN and every row drew token 0; a subnormal one (flushed to 0 on the device) is the smallest normal
    logits = (logits - logits.max(axis=-1, keepdims=True)) / max(params.temperature, TINY)
    if params.min_p > 0:  # vLLM's order: after the temperature, before top-k / top-p (p / p_max = exp(x - max))
        logits = jnp.where(jnp.exp(logits) < params.min_p, -jnp.inf, logits)
    if 0 < params.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, params.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if params.top_p < 1:
        # most likely first, a tie's higher ids first: transformers' and vLLM's ascending stable sort drop the lower
        # ids of a tie at the cut first
        order = jnp.flip(jnp.argsort(logits, axis=-1), axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always)
        drop_sorted = jnp.cumsum(probs, axis=-1) - probs >= params.top_p
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)
