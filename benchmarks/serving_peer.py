"""The same-device peer of `benchmarks/serving.py`: transformers' continuous batching on the benchmark's weights
(teacher wiring) and its requests, in processes of its own.

    python benchmarks/serving_peer.py weights SPEC.json DIR OUT.json   # JAX: the weights, as a Llama checkpoint in DIR
    python benchmarks/serving_peer.py run SPEC.json DIR OUT.json       # torch: transformers on DIR, the requests

serving.py runs both before its own process touches the accelerator (a JAX process holds its memory until it exits,
and the peer sizes its KV cache from the memory free beside its weights), one after the other, so that JAX and torch
never share a process (nor their CUDA libraries). `weights` builds the weights with serving.py's own `build_model`
(the same seed on the same platform: the same weights, which the digest in OUT confirms against serving.py's) and
writes the teacher's tensors (a SwiftKV model's own projections left out) as a transformers `LlamaForCausalLM`
checkpoint, a safetensors file a layer. `run` loads it with `from_pretrained` and drives `generate_batch`'s machinery
directly: `continuous_batching_context_manager` (warmed up, as `generate_batch` does, before anything is timed), every
request added at t = 0 with its own `max_new_tokens`, greedy, no EOS (the same work as serving.py's
`stop_token_ids=[]`), per-token timestamps recorded, results streamed (each output holds a request's tokens so far),
so that a run past its time limit still counts every token it generated (`cut_off`). Attention "paged|sdpa" (what
the GPU host's transformers runs without flash-attn); the KV cache at 90% of the free memory on a GPU
(`max_memory_percent`), on a CPU as many pages of serving.py's page size as the engine's pool; the rest transformers'
defaults (the resolved values are in OUT). Where this transformers lacks the continuous-batching API, or the platform
is a GPU and torch has no CUDA, OUT says "skipped" and why.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

ATTENTION = "paged|sdpa"


def teacher_tensors(model):
    """(HF name, numpy array in torch's layout) for each tensor of `model`'s teacher wiring, one at a time."""
    import jax
    import numpy as np
    from flax.traverse_util import flatten_dict

    from swiftkv_jax.checkpoints.hf_layout import tensor_entries

    params = flatten_dict(model.params)
    for entry in tensor_entries(model.config):
        if "swiftkv" in entry.hf_name:  # the student's own projections and norm: not the teacher's
            continue
        leaf = params[entry.path]
        yield entry.hf_name, entry.to_hf(np.asarray(jax.device_get(leaf[entry.index] if entry.index else leaf)))


def llama_config(cfg) -> dict:
    """config.json of the teacher wiring of `cfg` as a LlamaForCausalLM, with no EOS (every request runs to its
    length)."""
    from swiftkv_jax.checkpoints.hf_config import config_to_hf

    if cfg.family != "llama":
        raise ValueError(f"the transformers peer builds a LlamaForCausalLM; this model's family is {cfg.family!r}")
    plain = cfg.replace(num_key_value_layers=None, key_value_group_size=1)
    return {**config_to_hf(plain), "eos_token_id": None, "bos_token_id": None}


def write_weights(spec: dict, folder: Path) -> dict:
    """The benchmark's weights (teacher wiring) as a Llama checkpoint in `folder`: a safetensors file a layer."""
    import re

    import jax
    import numpy as np
    from safetensors.numpy import save_file

    import serving

    model = serving.build_model(serving.resolved_args(spec["args"]))
    digest = serving.weights_digest(model.params)
    config = llama_config(model.config)
    files = {}  # file -> {name: array}: the tensors come parameter by parameter (each over every layer)
    for name, array in teacher_tensors(model):
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        files.setdefault(f"model-{'layer-%03d' % int(layer[1]) if layer else 'rest'}.safetensors", {})[name] = array
    del model
    weight_map, total = {}, 0
    for file, tensors in sorted(files.items()):
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(v.nbytes for v in tensors.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return dict(status="ok", weights_digest=digest, platform=jax.default_backend(), files=len(files), bytes=total)


def missing_api(model_class) -> str | None:
    """What this transformers lacks of the continuous-batching API the peer drives, or None."""
    for name in ("generate_batch", "continuous_batching_context_manager"):
        if not hasattr(model_class, name):
            return name
    try:
        from transformers.generation import ContinuousBatchingConfig  # noqa: F401
    except ImportError:
        return "transformers.generation.ContinuousBatchingConfig"
    return None


def run(spec: dict, folder: Path) -> dict:
    """transformers' continuous batching on the checkpoint in `folder` and the first spec["num_requests"] requests."""
    started = time.perf_counter()
    import torch
    import transformers
    from transformers import GenerationConfig, LlamaForCausalLM

    import serving

    versions = {"transformers": transformers.__version__, "torch": torch.__version__}
    missing = missing_api(LlamaForCausalLM)
    if missing:
        return dict(status="skipped", versions=versions,
                    reason=f"transformers {transformers.__version__} has no {missing} (continuous batching)")
    from transformers.generation import ContinuousBatchingConfig

    if spec["platform"] == "gpu" and not torch.cuda.is_available():
        return dict(status="skipped", versions=versions,
                    reason=f"torch {torch.__version__} sees no CUDA device: the peer would not run on this GPU")
    device = "cuda" if spec["platform"] == "gpu" else "cpu"
    peer = LlamaForCausalLM.from_pretrained(folder, dtype=getattr(torch, spec["args"]["dtype"]),
                                            attn_implementation=ATTENTION).to(device).eval()
    args = serving.resolved_args(spec["args"])
    workload = serving.make_workload(args)
    n = spec["num_requests"]
    prompts, output_lens = workload["prompts"][:n], [int(o) for o in workload["output_lens"][:n]]
    generation = GenerationConfig(do_sample=False, max_new_tokens=max(output_lens), eos_token_id=None, pad_token_id=0)
    settings = dict(allow_block_sharing=False)  # the rest transformers' own (the resolved values are recorded)
    if device == "cuda":
        settings["max_memory_percent"] = spec["memory_fraction"]
    else:  # a CPU reports no free memory: the engine's pool, in pages of the engine's size
        settings.update(block_size=args.page_size, num_blocks=spec["cpu_num_pages"])
    result = dict(status="ok", versions=versions, device=device, settings=settings, attention=ATTENTION,
                  num_requests=n)
    # the run's limit: what the process has left, less what stopping the manager and writing take
    limit = min(spec["time_limit_s"], spec["total_limit_s"] - (time.perf_counter() - started) - 30)
    with peer.continuous_batching_context_manager(generation_config=generation,
                                                  continuous_batching_config=ContinuousBatchingConfig(**settings),
                                                  block=True, timeout=10) as manager:
        result["attention_in_use"] = peer.config._attn_implementation
        resolved = manager.continuous_batching_config
        result["resolved"] = {k: getattr(resolved, k, None) for k in (
            "block_size", "num_blocks", "max_batch_tokens", "max_memory_percent", "max_requests_per_batch",
            "use_cuda_graph", "use_async_batching")}
        result["startup_s"] = time.perf_counter() - started
        start = time.perf_counter()
        for i, (prompt, length) in enumerate(zip(prompts, output_lens)):
            manager.add_request(prompt, request_id=str(i), max_new_tokens=length, record_timestamps=True,
                                streaming=True)
        stamps, errors, cut_off, done = [[] for _ in range(n)], [], False, 0
        while done < n:
            if time.perf_counter() - start > limit:
                cut_off = True
                break
            out = manager.get_result(timeout=0.2)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError(f"transformers' generation thread stopped with {n - done} requests unfinished")
                continue
            stamps[int(out.request_id)] = out.timestamps or []  # each output holds the request's stamps so far
            if out.is_finished():
                done += 1
                if out.error:
                    errors.append(f"{out.request_id}: {out.error}"[:300])
        elapsed = time.perf_counter() - start
        result.update(times=[[t - start for t in ts] for ts in stamps], elapsed_s=elapsed, cut_off=cut_off,
                      finished=done, errors=errors[:10])
    return result  # the manager stopped (on a cut-off, after at most its 10 s join)


def main(argv=None) -> int:
    mode, spec_path, folder, out_path = argv or sys.argv[1:]
    spec = json.loads(Path(spec_path).read_text())
    start = time.perf_counter()
    try:
        result = write_weights(spec, Path(folder)) if mode == "weights" else run(spec, Path(folder))
    except Exception:  # noqa: BLE001 - recorded for serving.py, which reports it
        result = dict(status="failed", reason=traceback.format_exc()[-3000:])
    result["seconds"] = time.perf_counter() - start
    Path(out_path).write_text(json.dumps(result, default=str))
    print(f"transformers peer, {mode}: {result['status']} {result.get('reason', '')}", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # os._exit: a cut-off run leaves transformers' generation thread working; nothing else is left to save
    import os

    os._exit(code)
