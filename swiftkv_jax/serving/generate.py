"""`generate`: prefill, then the whole token loop on device (`lax.while_loop`) with the cache donated."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from swiftkv_jax.model.cached import unstack_layers
from swiftkv_jax.model.config import ModelConfig, serves_swiftkv
from swiftkv_jax.checks import flag, integer, token_ids
from swiftkv_jax.model.model import Model, check_params
from swiftkv_jax.serving.cache import KVCache, init_cache
from swiftkv_jax.serving.engine import decode_step, prefill
from swiftkv_jax.serving.kernel_choice import serving_config
from swiftkv_jax.serving.errors import InvalidRequest
from swiftkv_jax.serving.sampling import (SamplingParams, check_min_tokens, check_penalties, check_seed, check_stop_ids,
                                         sample)
from swiftkv_jax.serving.tensor_parallel import activation_sharding, for_serving


@functools.partial(jax.jit, static_argnames=("config", "swiftkv", "sampling", "max_new_tokens", "chunk_size",
                                             "on_token", "with_logprobs", "mesh"), donate_argnames=("cache",))
def generate_tokens(params, cache: KVCache, tokens, prompt_lengths, rng, stop_ids, *, config: ModelConfig,
                    swiftkv: bool, sampling: SamplingParams, max_new_tokens: int, chunk_size: Optional[int],
                    on_token: Optional[Callable] = None, with_logprobs: bool = True, mesh: Optional[Mesh] = None):
    """(tokens [B, N], logprobs [B, N], generated counts [B], cache); rows stop at a stop id or after N tokens.

    logprobs are under the model's own distribution (before temperature / top-k / top-p); zeros unless
    with_logprobs (which costs a log-softmax over the vocabulary per step).
    on_token(tokens [B], live [B]): a host callback per step, in order, for streaming (it costs a
    device-to-host sync per token; None keeps the loop free of it). mesh: the tensor-parallel mesh that params and
    cache lie on (`tensor_parallel`), None for one device.
    """
    with activation_sharding(config, mesh):
        return _generate_tokens(params, cache, tokens, prompt_lengths, rng, stop_ids, config, swiftkv, sampling,
                                max_new_tokens, chunk_size, on_token, with_logprobs, ordered=mesh is None)


def _generate_tokens(params, cache, tokens, prompt_lengths, rng, stop_ids, config, swiftkv, sampling, max_new_tokens,
                     chunk_size, on_token, with_logprobs, ordered):
    params = unstack_layers(params, config)  # once, outside the token loop
    logits, cache = prefill(params, cache, tokens, prompt_lengths, config=config, swiftkv=swiftkv,
                            chunk_size=chunk_size)
    batch = tokens.shape[0]
    out = jnp.zeros((batch, max_new_tokens), jnp.int32)
    logprobs = jnp.zeros((batch, max_new_tokens), jnp.float32)

    def body(state):
        step, cache, logits, rng, out, logprobs, done, count = state
        rng, key = jax.random.split(rng)
        token = sample(logits, key, sampling)
        live = ~done
        out = out.at[:, step].set(jnp.where(live, token, 0))
        if with_logprobs:
            logprob = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), token[:, None], axis=-1)[:, 0]
            logprobs = logprobs.at[:, step].set(jnp.where(live, logprob, 0.0))
        count = count + live
        if on_token is not None:
            # JAX orders effects on one device only; on a mesh the loop's own sequence keeps the steps in order (each
            # iteration's callback runs inside that iteration)
            jax.debug.callback(on_token, token, live, ordered=ordered)
        done = done | jnp.isin(token, stop_ids) | (count >= max_new_tokens)
        logits, cache = decode_step(params, cache, token, config=config, swiftkv=swiftkv)
        return step + 1, cache, logits, rng, out, logprobs, done, count

    def cond(state):
        step, done = state[0], state[6]
        return (step < max_new_tokens) & ~jnp.all(done)

    state = (jnp.int32(0), cache, logits, rng, out, logprobs, jnp.zeros((batch,), bool), jnp.zeros((batch,), jnp.int32))
    _, cache, _, _, out, logprobs, _, count = jax.lax.while_loop(cond, body, state)
    return out, logprobs, count, cache


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]                      # generated ids per prompt (stop id included, if hit)
    logprobs: Optional[list[list[float]]] = None
    texts: Optional[list[str]] = None


FINE_BUCKETS_FROM = 2048  # longer prompts: four buckets an octave (a power of two would pad 16385 tokens to 32768)


def padded_length(length: int, chunk: Optional[int]) -> int:
    """Prompts are padded to a bucket to reuse compiles: a multiple of the chunk; else a power of two >= 16 up to
    FINE_BUCKETS_FROM and, past it, a multiple of an eighth of the next power of two (four buckets an octave, less
    than 25% padding: the projections and MLP run on every padded token, so a power of two cost up to twice the
    work; a compile more an octave is the price)."""
    if chunk:
        return -(-length // chunk) * chunk
    bucket = max(16, 1 << (length - 1).bit_length())
    if bucket <= FINE_BUCKETS_FROM:
        return bucket
    step = bucket // 8
    return -(-length // step) * step


def generate(model: Model, prompts: Union[Sequence[Sequence[int]], Sequence[str], str], max_new_tokens: int = 64,
             *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, min_p: float = 0.0,
             repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             logit_bias: Optional[dict] = None, min_tokens: int = 0, stop_token_ids: Optional[Sequence[int]] = None,
             swiftkv: Optional[bool] = None,
             cache_dtype="auto", max_len: Optional[int] = None, prefill_chunk: Optional[int] = None,
             logprobs: bool = False, tokenizer=None, decode_attention_impl: Optional[str] = None,
             attention_impl: Optional[str] = None, on_token: Optional[Callable] = None,
             kv_scales: Optional[str] = None, mesh: Optional[Mesh] = None) -> Generation:
    """Generate for a batch of prompts (token id lists, or text with a `tokenizer`).

    swiftkv=None serves a SwiftKV model in SwiftKV wiring and a plain model as is; swiftkv=False serves a
    SwiftKV model as its teacher. Stops at `stop_token_ids` (default: the config's EOS ids).
    min_p (vLLM's, 0 off) as `sk.Engine`'s; repetition_penalty, presence_penalty and frequency_penalty only off
    (1, 0, 0): they need per-sequence token counts, which `sk.Engine` keeps (InvalidRequest otherwise); logit_bias
    only None or {} and min_tokens (vLLM's) only 0: `sk.Engine` applies them.
    max_len: cache length (default: the longest prompt + max_new_tokens, at least the prompts' bucket,
    `padded_length`: a power of two >= 16, finer past 2048 tokens, or a multiple of prefill_chunk; a max_len that
    holds prompt + max_new_tokens takes the prompts as they are, unless chunked). decode_attention_impl: the
    few-query attention over the cache, attention_impl: prefill's (defaults: the config's off a GPU, the measured
    fastest on one, see `kernel_choice`). on_token(tokens [B], live [B]) streams: it is called
    on the host as each token is sampled. cache_dtype: "auto" (the default: the model's compute dtype,
    `model.config.dtype`, as vLLM's and transformers'), a float dtype, or float8_e4m3fn / int8 (quantised on write,
    read back in fp32) with kv_scales "per-token-head" (default) or "per-layer" (`model.kv_quant`).
    mesh: serve tensor-parallel on this mesh (`serving_mesh(N)`): the weights, unless already placed there
    (`load_sharded`), are split by heads (`tensor_parallel.shard_model`), and so is the cache.
    """
    if not isinstance(model, Model):
        raise TypeError(f"generate takes a Model (as sk.load and sk.init return), got {type(model).__name__}")
    check_params(model.config, model.params)  # another config's weights ran silently (extra layers) or failed in flax
    if on_token is not None and not callable(on_token):
        raise TypeError(f"on_token must be a function on_token(tokens, live), got {on_token!r:.60}")
    if tokenizer is not None and not callable(tokenizer):
        raise TypeError(f"tokenizer must be a tokenizer (e.g. AutoTokenizer.from_pretrained(DIR)), got "
                        f"{tokenizer!r:.60}")
    model = for_serving(model, mesh)
    cfg = serving_config(model.config, cache_dtype, paged=False, attention_impl=attention_impl,
                         decode_attention_impl=decode_attention_impl)
    swiftkv = serves_swiftkv(cfg, swiftkv)
    sampling = SamplingParams(temperature, top_k, top_p, min_p)
    if check_penalties(repetition_penalty, presence_penalty, frequency_penalty) != (1.0, 0.0, 0.0):
        raise InvalidRequest("repetition_penalty, presence_penalty and frequency_penalty need each sequence's token "
                             "counts, which sk.generate does not keep: use sk.Engine (add_request takes them) or the "
                             "server", "repetition_penalty" if repetition_penalty != 1 else
                             "presence_penalty" if presence_penalty != 0 else "frequency_penalty")
    if logit_bias:
        raise InvalidRequest("logit_bias is applied by sk.Engine (add_request takes it) and the server, not by "
                             "sk.generate: use sk.Engine", "logit_bias")
    if isinstance(prompts, str):
        prompts = [prompts]
    if not hasattr(prompts, "__iter__") or isinstance(prompts, dict):
        raise ValueError(f"prompts must be a list of token id lists (or of texts, with a tokenizer), got "
                         f"{prompts!r:.80}")
    prompts = list(prompts)  # a generator is read once, not consumed by the checks below
    if any(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer (pass tokenizer=, or token id lists)")
        prompts = [tokenizer(p)["input_ids"] for p in prompts]
    if any(isinstance(p, (int, np.integer)) for p in prompts):
        raise ValueError("prompts is a batch: a list of token id lists (one prompt: [[1, 2, 3]], not [1, 2, 3])")
    # every number by name, before any compile: int() truncated float ids, a float count failed inside jnp.zeros
    prompts = [token_ids("prompts", p) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    max_new_tokens = integer("max_new_tokens", max_new_tokens, 1)
    if check_min_tokens(min_tokens, max_new_tokens):  # the range checked first: a bad value names its range
        raise InvalidRequest("min_tokens is applied by sk.Engine (add_request takes it) and the server, not by "
                             "sk.generate: use sk.Engine", "min_tokens")
    seed = check_seed(seed)
    logprobs = flag("logprobs", logprobs)
    max_len = None if max_len is None else integer("max_len", max_len, 1, optional=True)
    prefill_chunk = None if prefill_chunk is None else integer("prefill_chunk", prefill_chunk, 0, optional=True) or None
    if stop_token_ids is not None:
        stop_token_ids = token_ids("stop_token_ids", stop_token_ids)
        check_stop_ids(stop_token_ids, cfg.vocab_size)  # as the Engine's requests
    flat = [t for p in prompts for t in p]
    if min(flat) < 0 or max(flat) >= cfg.vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {cfg.vocab_size}), got [{min(flat)}, {max(flat)}]")
    longest = max(len(p) for p in prompts)
    limit = cfg.max_position_embeddings  # beyond it RoPE gives degenerate text: refused, as the Engine and vLLM do
    if longest + max_new_tokens > limit:
        fix = (f"lower max_new_tokens to at most {limit - longest}" if longest < limit else
               f"shorten the prompt to fewer than {limit} tokens")
        raise ValueError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} needs "
                         f"{longest + max_new_tokens} positions, but the model has {limit} "
                         f"(max_position_embeddings): {fix}")
    padded = padded_length(longest, prefill_chunk)
    if max_len is not None and not prefill_chunk and longest + max_new_tokens <= max_len < padded:
        padded = max_len  # the bucket only spares compiles: a cache that holds the request is not grown for it
    needed = max(longest + max_new_tokens, padded)
    if max_len is None:
        max_len = needed
    elif needed > max_len:
        raise ValueError(
            f"a prompt of {longest} tokens (padded to {padded}) plus max_new_tokens={max_new_tokens} needs "
            f"{needed} cache entries, but max_len is {max_len}: raise max_len or shorten the prompt"
            + (" (or prefill it unchunked)" if prefill_chunk and longest + max_new_tokens <= max_len else "")
        )
    tokens = np.zeros((len(prompts), padded), np.int32)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = p
    stops = stop_token_ids if stop_token_ids is not None else (cfg.eos_token_id or ())
    stop_ids = jnp.asarray(list(stops) or [-1], jnp.int32)
    cache = init_cache(cfg, len(prompts), max_len, swiftkv, cache_dtype, kv_scales, mesh=mesh)
    out, lps, count, _ = generate_tokens(
        model.params, cache, jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32),
        jax.random.key(seed), stop_ids, config=cfg, swiftkv=swiftkv, sampling=sampling,
        max_new_tokens=max_new_tokens, chunk_size=prefill_chunk, on_token=on_token, with_logprobs=logprobs,
        mesh=mesh)
    out, lps, count = jax.device_get((out, lps, count))
    result = Generation([out[i, : count[i]].tolist() for i in range(len(prompts))])
    if logprobs:
        result.logprobs = [lps[i, : count[i]].tolist() for i in range(len(prompts))]
    if tokenizer is not None:
        result.texts = [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
    return result
