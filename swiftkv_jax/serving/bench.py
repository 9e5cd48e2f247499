"""Serving benchmark: SwiftKV wiring against the teacher wiring of the same weights, side by side in one run.

    from swiftkv_jax.serving import bench as B
    model = B.random_model("llama-3.1-8b")                        # or sk.load(DIR)
    rows = B.bench(model, prompt_len=2048, gen_len=128, batch=1)  # one row per wiring, JSON-serialisable
    print(B.format_table(rows))

Per wiring, on `batch` random prompts of exactly `prompt_len` tokens (no padding):
- TTFT: the engine's `prefill` + `sample` of the first token, one jitted call with the cache donated.
- TPOT: a jitted on-device loop (`lax.fori_loop`) of `gen_len` greedy `decode_step`s with the cache donated
  and no early stop, divided by gen_len. The loop feeds the prefill's token, so a run produces
  gen_len + 1 tokens per sequence: exactly what `sk.generate(..., max_new_tokens=gen_len + 1)` returns.
- decode tokens/s = batch * gen_len / loop time; end-to-end tokens/s = batch * (gen_len + 1) / (TTFT + loop).
- gen_len 0 times the prefill only: no decode loop is compiled or run, the decode fields are None and its runs
  [] (what a prefill-speed comparison, such as the demo's, needs at half the compiles).
- KV-cache bytes are the allocated cache's, compile times are reported apart from the timings; each timing
  is the median of `repeats` runs after one untimed warm-up, each run on a fresh cache. The two wirings take
  turns run by run (in the other order each run), so a slower spell of the device falls on both.
With a device memory bandwidth, a TPOT roofline: bytes one decode step must read (the weights this wiring
uses, except the embedding table when untied, of which a step gathers `batch` rows; plus K/V: each of the L
layers reads its own or its group owner's entries, at the mean length over the loop) / bandwidth.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from swiftkv_jax.checkpoints.hf_config import config_from_hf
from swiftkv_jax.model.cached import unstack_layers
from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.model.kv_quant import as_format
from swiftkv_jax.model.model import Model, cast, init, param_shardings
from swiftkv_jax.model.swiftkv import to_swiftkv
from swiftkv_jax.serving.cache import cache_layers, init_cache
from swiftkv_jax.serving.engine import decode_step, prefill
from swiftkv_jax.serving import tensor_parallel
from swiftkv_jax.serving.kernel_choice import serving_config
from swiftkv_jax.serving.sampling import SamplingParams, sample

# Llama-3.1-8B(-Instruct)'s published config.json: the numbers are written here once.
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
}
# Llama-3.1-70B's published config.json differs from the 8B's in these fields only.
LLAMA_3_1_70B = {**LLAMA_3_1_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                 "num_attention_heads": 64}
TINY = {  # seconds on a CPU; AcrossKV g = 2 so that the KV saving is visible (cache: 2 + 1 of 4 layers)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "initializer_range": 0.1, "torch_dtype": "float32",
}


def _swiftkv(hf: dict, l: int, g: int) -> dict:
    """The config.json of `hf` made SwiftKV (SWIFTKV.md §5)."""
    return {**hf, "model_type": "llama_swiftkv", "architectures": ["LlamaSwiftKVForCausalLM"],
            "num_key_value_layers": l, "key_value_group_size": g, "swiftkv": True}


# name -> config.json (HF layout). llama-3.1-8b is Snowflake's published SwiftKV-8B layout (l = 16, g = 1).
PRESETS = {
    "llama-3.1-8b": _swiftkv(LLAMA_3_1_8B, 16, 1),
    "llama-3.1-8b-acrosskv4": _swiftkv(LLAMA_3_1_8B, 16, 4),
    "llama-3.1-70b": _swiftkv(LLAMA_3_1_70B, 40, 1),  # the published SwiftKV-70B's l = 40 of 80
    "tiny": _swiftkv(TINY, 2, 2),
}
GREEDY = SamplingParams()


def preset_config(name: str, **runtime) -> ModelConfig:
    """ModelConfig of a preset (`runtime`: param_dtype, dtype, attention_impl, ... as in `config_from_hf`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: available are {', '.join(PRESETS)}")
    return config_from_hf(PRESETS[name], **runtime)


def random_model(preset_or_config: Union[str, ModelConfig], dtype="bfloat16", seed: int = 0,
                 mesh: Optional[Mesh] = None) -> Model:
    """Random weights for a preset or config: `init` (in `dtype`) + `to_swiftkv` (when the config has SwiftKV
    layers, with its l and g) + `cast`, traced as one jitted program, so the teacher and the student are
    never held side by side. The key is an "rbg" key (XLA's RngBitGenerator): threefry's random bits would
    add ~0.8x the weights in temporaries. XLA's own estimate for llama-3.1-8b in bf16: 15.7 GiB of weights
    + 10.5 GiB of temporaries (three stacked MLP weights before the split at layer l). The weights depend
    on the seed and the platform (the generator is the backend's). On a tensor-parallel `mesh` the weights are born
    split (`tensor_parallel`), so a model larger than one device can be benchmarked."""
    cfg = preset_config(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    plain = cfg.replace(num_key_value_layers=None, key_value_group_size=1, param_dtype=dtype, dtype=dtype)

    def build(rng):
        model = init(plain, rng)
        if cfg.is_swiftkv:
            model = to_swiftkv(model, cfg.num_key_value_layers, cfg.key_value_group_size)
        return cast(model, dtype)

    if mesh is None:
        return jax.jit(build)(jax.random.key(seed, impl="rbg"))
    tp_plan = tensor_parallel.plan(cfg, mesh.shape["tensor"])
    key = jax.random.key(seed, impl="rbg")
    built = jax.eval_shape(build, key).config
    out_shardings = param_shardings(built, mesh, tp_plan.placement_rules)
    params = jax.jit(lambda rng: build(rng).params, out_shardings=out_shardings)(key)
    return tensor_parallel.finish_placement(Model(built, params), mesh, tp_plan)


def random_prompts(vocab_size: int, batch: int, prompt_len: int, seed: int = 0) -> np.ndarray:
    """The benchmark's prompts: int32 [batch, prompt_len], uniform over the vocabulary."""
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, prompt_len), dtype=np.int32)


def _first_token(params, cache, tokens, lengths, *, config, swiftkv, chunk_size):
    logits, cache = prefill(params, cache, tokens, lengths, config=config, swiftkv=swiftkv, chunk_size=chunk_size)
    return sample(logits, jax.random.key(0), GREEDY), cache


def _decode_loop(params, cache, token, *, config, swiftkv, steps):
    """`steps` greedy decode steps from `token` [B], no early stop: (tokens [B, steps], cache)."""
    def body(i, carry):
        cache, token, out = carry
        logits, cache = decode_step(params, cache, token, config=config, swiftkv=swiftkv)
        token = sample(logits, jax.random.key(0), GREEDY)
        return cache, token, out.at[:, i].set(token)

    out = jnp.zeros((token.shape[0], steps), jnp.int32)
    cache, _, out = jax.lax.fori_loop(0, steps, body, (cache, token, out))
    return out, cache


def _compile(fn, *args):
    start = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=(1,)).lower(*args).compile()
    return compiled, time.perf_counter() - start


def _timed(fn, *args):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def _nbytes(tree) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree)))


def step_param_bytes(model: Model, swiftkv: bool) -> int:
    """Bytes of the weights one decode step reads in this wiring: SwiftKV skips the original q/k/v of layers
    >= l, the teacher every *_swiftkv weight; an untied embedding table is gathered (`batch` rows), not read."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]:
        names = [getattr(key, "key", str(key)) for key in path]
        if swiftkv and "swiftkv_groups" in names and {"q_proj", "k_proj", "v_proj"} & set(names):
            continue
        if not swiftkv and any(name.endswith("_swiftkv") for name in names):
            continue
        if "embed_tokens" in names and not model.config.tie_word_embeddings:
            continue
        total += leaf.size * leaf.dtype.itemsize
    return int(total)


@dataclasses.dataclass
class _Wiring:
    """One wiring's compiled prefill (and decode loop), and its timed runs."""
    swiftkv: bool
    fresh: Callable  # () -> an empty cache of this wiring
    first: Any
    loop: Any
    prefill_compile_s: float
    decode_compile_s: Optional[float]
    ttfts: list = dataclasses.field(default_factory=list)
    loops: list = dataclasses.field(default_factory=list)
    kv_bytes: int = 0
    token: Any = None
    out: Any = None


def _compile_wiring(cfg: ModelConfig, params, swiftkv: bool, prompts, lengths, *, gen_len, cache_dtype, chunk,
                    mesh) -> _Wiring:
    batch, prompt_len = prompts.shape
    fresh = lambda: init_cache(cfg, batch, prompt_len + gen_len, swiftkv, cache_dtype, mesh=mesh)
    abstract_cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                  jax.block_until_ready(fresh()))
    with tensor_parallel.activation_sharding(cfg, mesh):  # traced inside (`lower`)
        first, prefill_compile_s = _compile(
            functools.partial(_first_token, config=cfg, swiftkv=swiftkv, chunk_size=chunk),
            params, abstract_cache, prompts, lengths)
        loop, decode_compile_s = _compile(
            functools.partial(_decode_loop, config=cfg, swiftkv=swiftkv, steps=gen_len),
            params, abstract_cache, jax.ShapeDtypeStruct((batch,), jnp.int32)) if gen_len else (None, None)
    return _Wiring(swiftkv, fresh, first, loop, prefill_compile_s, decode_compile_s)


def _run_once(w: _Wiring, params, prompts, lengths, record: bool) -> None:
    cache = jax.block_until_ready(w.fresh())
    w.kv_bytes = int(cache.nbytes)
    (w.token, cache), ttft = _timed(w.first, params, cache, prompts, lengths)
    if w.loop is not None:
        (w.out, cache), loop_s = _timed(w.loop, params, cache, w.token)
    del cache
    if record:
        w.ttfts.append(ttft)
        w.loops += [loop_s] if w.loop is not None else []


def _wiring_row(model: Model, params, w: _Wiring, prompts, *, gen_len, repeats, cache_dtype, chunk, bandwidth,
                keep_tokens, mesh) -> dict:
    cfg, swiftkv = model.config, w.swiftkv
    batch, prompt_len = prompts.shape
    ttft = statistics.median(w.ttfts)
    loop_s = statistics.median(w.loops) if w.loops else None
    row = {
        "wiring": ("swiftkv" if swiftkv else "teacher") if cfg.is_swiftkv else "plain",
        "swiftkv": swiftkv, "batch": batch, "prompt_len": prompt_len, "gen_len": gen_len, "repeats": repeats,
        "num_layers": cfg.num_hidden_layers, "num_key_value_layers": cfg.num_key_value_layers,
        "key_value_group_size": cfg.key_value_group_size, "param_dtype": cfg.param_dtype,
        "compute_dtype": cfg.dtype, "cache_dtype": as_format(cache_dtype).dtype,
        "kv_scales": as_format(cache_dtype).scales,
        "attention_impl": cfg.attention_impl, "decode_attention_impl": cfg.decode_attention_impl,
        "prefill_chunk": chunk, "device": jax.devices()[0].device_kind,
        "tensor_parallel": 1 if mesh is None else int(mesh.shape["tensor"]),
        "params": int(sum(a.size for a in jax.tree.leaves(params))), "param_bytes": _nbytes(params),
        "step_param_bytes": step_param_bytes(model, swiftkv),
        "cache_layers": cache_layers(cfg, swiftkv), "kv_cache_bytes": w.kv_bytes,
        "ttft_s": ttft, "ttft_runs_s": w.ttfts, "prefill_tokens_per_s": batch * prompt_len / ttft,
        "tpot_s": loop_s and loop_s / gen_len, "decode_loop_s": loop_s, "decode_loop_runs_s": w.loops,
        "decode_tokens_per_s": loop_s and batch * gen_len / loop_s,
        "e2e_tokens_per_s": batch * (gen_len + 1) / (ttft + (loop_s or 0.0)),
        "prefill_compile_s": w.prefill_compile_s, "decode_compile_s": w.decode_compile_s,
    }
    if bandwidth and loop_s:
        entry = 2 * batch * cfg.num_key_value_heads * as_format(cache_dtype).bytes_per_token_head(cfg.head_dim)
        kv_read = cfg.num_hidden_layers * entry * (prompt_len + (gen_len + 1) / 2)
        step_bytes = row["step_param_bytes"] + kv_read
        row.update(memory_bandwidth=float(bandwidth), step_bytes=int(step_bytes),
                   tpot_roofline_s=step_bytes / bandwidth, roofline_fraction=step_bytes / bandwidth / row["tpot_s"])
    if keep_tokens:
        row["tokens"] = np.concatenate([np.asarray(w.token)[:, None]] + ([np.asarray(w.out)] if w.loop is not None
                                                                          else []), axis=1).tolist()
    return row


def expected_kv_ratio(config: ModelConfig) -> float:
    """KV-cache size of the SwiftKV wiring over the teacher's: (l + (L - l) / g) / L."""
    return config.num_kv_cache_layers / config.num_hidden_layers


def bench(model: Model, *, prompt_len: int, gen_len: int, batch: int, repeats: int = 3, cache_dtype="auto",
          decode_attention_impl: Optional[str] = None, attention_impl: Optional[str] = None,
          prefill_chunk: Optional[int] = None, memory_bandwidth: Optional[float] = None, seed: int = 0,
          keep_tokens: bool = False, mesh: Optional[Mesh] = None) -> list[dict]:
    """Rows [swiftkv, teacher] for a SwiftKV model, [plain] otherwise; see the module docstring.

    The swiftkv row carries `vs_teacher`: swiftkv / teacher ratios of ttft, tpot, kv_bytes, e2e_tokens_per_s
    and kv_bytes_expected = (l + (L - l) / g) / L. memory_bandwidth (bytes/s) adds the TPOT roofline.
    attention_impl / decode_attention_impl: prefill's / few-query attention's (defaults: `sk.generate`'s).
    keep_tokens adds each row's generated tokens [batch, gen_len + 1] (prompts: `random_prompts(..., seed)`).
    mesh: serve tensor-parallel on it (`tensor_parallel.serving_mesh`); kv_cache_bytes then counts every device's.
    """
    for name, value in (("prompt_len", prompt_len), ("gen_len", gen_len), ("batch", batch), ("repeats", repeats)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "gen_len" else 1):
            raise ValueError(f"{name} must be a {'non-negative' if name == 'gen_len' else 'positive'} int"
                             f"{' (0: the prefill only)' if name == 'gen_len' else ''}, got {value!r}")
    if prefill_chunk is not None and (prefill_chunk < 1 or prompt_len % prefill_chunk):
        raise ValueError(f"prefill_chunk {prefill_chunk} must divide prompt_len {prompt_len}")
    if memory_bandwidth is not None and not 0 < memory_bandwidth < float("inf"):
        raise ValueError(f"memory_bandwidth must be a positive number of bytes/s (H200: 4.8e12), "
                         f"got {memory_bandwidth!r}")
    cache_dtype = as_format(cache_dtype, model_dtype=model.config.dtype)  # "auto": the rows record the dtype it is
    cfg = serving_config(model.config, cache_dtype, paged=False, attention_impl=attention_impl,
                         decode_attention_impl=decode_attention_impl)
    model = tensor_parallel.for_serving(Model(cfg, model.params), mesh)
    cfg = model.config
    prompts = tensor_parallel.replicated(mesh, random_prompts(cfg.vocab_size, batch, prompt_len, seed))
    # the weights in serving layout once, as an engine holds them (both wirings read the same): no timing includes
    # the unstacking copy
    params = jax.block_until_ready(jax.jit(unstack_layers, static_argnums=1)(model.params, cfg))
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
    wirings = [_compile_wiring(cfg, params, swiftkv, prompts, lengths, gen_len=gen_len, cache_dtype=cache_dtype,
                               chunk=prefill_chunk, mesh=mesh)
               for swiftkv in ((True, False) if cfg.is_swiftkv else (False,))]
    # run 0 warms up; then the wirings take turns, in the other order each run, so that a slower spell of the
    # machine falls on both and their ratios stay true (one demo's CPU run timed 5 of one wiring, then 5 of the
    # other, and a 50% student's prefill came out 0.79 of its teacher's where 0.47-0.50 was measured again)
    for run in range(repeats + 1):
        for w in (wirings if run % 2 else wirings[::-1]):
            _run_once(w, params, prompts, lengths, record=run > 0)
    rows = [_wiring_row(model, params, w, prompts, gen_len=gen_len, repeats=repeats, cache_dtype=cache_dtype,
                        chunk=prefill_chunk, bandwidth=memory_bandwidth, keep_tokens=keep_tokens, mesh=mesh)
            for w in wirings]
    if cfg.is_swiftkv:
        fast, slow = rows
        fast["vs_teacher"] = {
            "ttft": fast["ttft_s"] / slow["ttft_s"], "tpot": fast["tpot_s"] / slow["tpot_s"] if gen_len else None,
            "kv_bytes": fast["kv_cache_bytes"] / slow["kv_cache_bytes"],
            "kv_bytes_expected": expected_kv_ratio(cfg),
            "e2e_tokens_per_s": fast["e2e_tokens_per_s"] / slow["e2e_tokens_per_s"]}
    return rows


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def format_table(rows: list[dict]) -> str:
    """A printable table of `bench` rows, with the swiftkv / teacher ratios below it."""
    first = rows[0]
    lines = [f"batch {first['batch']} x prompt {first['prompt_len']} + {first['gen_len']} generated, "
             f"{_count(first['params'])} params {first['param_dtype']}, KV {first['cache_dtype']}, "
             f"L={first['num_layers']} l={first['num_key_value_layers']} g={first['key_value_group_size']}, "
             f"attention {first['attention_impl']}/{first['decode_attention_impl']}, on {first['device']}"
             + (f" x {first['tensor_parallel']} (tensor parallel)" if first.get("tensor_parallel", 1) > 1 else "")]
    roofline = "memory_bandwidth" in first
    header = (f"{'wiring':<9}{'TTFT ms':>10}{'TPOT ms':>10}{'decode tok/s':>14}{'e2e tok/s':>11}"
              f"{'KV layers':>10}{'KV MiB':>10}{'compile s':>12}" + (f"{'roofline':>10}" if roofline else ""))
    lines.append(header)
    def number(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in rows:
        lines.append(f"{r['wiring']:<9}{r['ttft_s'] * 1e3:>10.2f}{number(r['tpot_s'] and r['tpot_s'] * 1e3, '.3f'):>10}"
                     f"{number(r['decode_tokens_per_s'], '.1f'):>14}{r['e2e_tokens_per_s']:>11.1f}"
                     f"{r['cache_layers']:>10}{r['kv_cache_bytes'] / 2**20:>10.1f}"
                     f"{r['prefill_compile_s']:>6.1f}+{number(r['decode_compile_s'], '.1f'):<5}"
                     + (f"{r['roofline_fraction']:>10.1%}" if roofline else ""))
    for r in rows:
        if "vs_teacher" in r:
            lines.append("swiftkv / teacher: "
                         + ", ".join(f"{k} {number(v, '.3f')}" for k, v in r["vs_teacher"].items()))
    return "\n".join(lines)


GIB = 2**30


def sizing_rows(config: ModelConfig, sizes, *, batch: int, max_len: int, cache_format) -> list[dict]:
    """`tensor_parallel.sizing` for each tensor-parallel size and wiring (sizes that cannot work get an `error`)."""
    rows = []
    for tensor in sizes:
        for swiftkv in ((True, False) if config.is_swiftkv else (False,)):
            wiring = ("swiftkv" if swiftkv else "teacher") if config.is_swiftkv else "plain"
            try:
                row = tensor_parallel.sizing(config, tensor, batch=batch, max_len=max_len, swiftkv=swiftkv,
                                             cache_format=cache_format)
            except ValueError as e:
                row = dict(tensor_parallel=tensor, error=str(e))
            rows.append(dict(row, wiring=wiring, param_dtype=config.param_dtype,
                             cache_dtype=as_format(cache_format, model_dtype=config.dtype).dtype))
    return rows


def format_sizing(rows: list[dict]) -> str:
    first = next(r for r in rows if "error" not in r)
    lines = [f"bytes per device, {first['param_dtype']} weights, KV cache {first['cache_dtype']} for batch "
             f"{first['batch']} x {first['max_len']} tokens (nothing allocated)",
             f"{'TP':>3} {'wiring':<8}{'weights GiB':>12}{'KV GiB':>9}{'total GiB':>10}{'KV heads':>9}"
             f"{'KV KiB/token':>13}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['tensor_parallel']:>3} {r['wiring']:<8}  {r['error']}")
            continue
        heads = f"{r['kv_heads_per_device']}" + (f" (x{r['kv_replicas']})" if r["kv_replicas"] > 1 else "")
        lines.append(f"{r['tensor_parallel']:>3} {r['wiring']:<8}{r['weight_bytes_per_device'] / GIB:>12.2f}"
                     f"{r['kv_cache_bytes_per_device'] / GIB:>9.2f}"
                     f"{(r['weight_bytes_per_device'] + r['kv_cache_bytes_per_device']) / GIB:>10.2f}{heads:>9}"
                     f"{r['kv_bytes_per_token_per_device'] / 1024:>13.1f}")
    return "\n".join(lines)
