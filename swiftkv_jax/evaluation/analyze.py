"""How much the residual stream changes from layer to layer, on held-out text: the observation SwiftKV rests on.

SwiftKV computes the KV of every later layer from the input of layer l; that works because the hidden states
of later layers change little. This measures it: the mean cosine similarity, over every real token of some
documents, between the residual stream at every pair of depths (0 = the embeddings, i = the output of layer
i - 1, L = the last layer's output before the final norm), in the teacher wiring by default.

    result = analyze("ckpt/llama-3.1-8b", "data/heldout/*.txt", max_tokens=8192)
    print(format_summary(result))   # and ./analysis/llama-3.1-8b/similarity.{json,png}
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from swiftkv_jax.evaluation.report import model_label, write_json
from swiftkv_jax.model.model import Model, intermediates
from swiftkv_jax.serving.generate import padded_length

JSON_FILE = "similarity.json"
PLOT_FILE = "similarity.png"
ARRAYS = ("similarity", "adjacent", "to_final", "mean_norm")


@jax.jit
def _batch_sums(residual, segment_ids):
    """(sum over real tokens of the [depth, depth] cosine matrix, of |h| per depth, the token count).

    residual [I, B, T, D] (I = L + 1 depths); a token is real where its segment id is not 0.
    """
    real = segment_ids != 0
    h = residual.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(h * h, axis=-1))                                       # [I, B, T]
    unit = jnp.where(real[None, :, :, None], h / jnp.maximum(norm, 1e-30)[..., None], 0.0)
    gram = jnp.einsum("IBTD,JBTD->IJ", unit, unit, precision=jax.lax.Precision.HIGHEST)
    return gram, jnp.sum(jnp.where(real[None], norm, 0.0), axis=(1, 2)), jnp.sum(real)


def _windows(documents_ids: Sequence[Sequence[int]], max_length: int, vocab_size: int) -> list[list[int]]:
    """Each document cut into disjoint windows of at most max_length tokens (each its own context)."""
    windows = []
    for d, ids in enumerate(documents_ids):
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError(f"document {d} has no tokens")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"document {d}: token ids must lie in [0, {vocab_size}), got [{min(ids)}, {max(ids)}]")
        windows += [ids[s: s + max_length] for s in range(0, len(ids), max_length)]
    return windows


def _pack(windows: list[list[int]], max_length: int) -> list[list[list[int]]]:
    """Windows packed in order into rows of at most max_length tokens (next fit)."""
    rows, used = [], max_length
    for w in windows:
        if used + len(w) > max_length:
            rows.append([])
            used = 0
        rows[-1].append(w)
        used += len(w)
    return rows


def _row_arrays(rows: list[list[list[int]]], width: int, count: int):
    """tokens, positions (restarting per window) and segment ids (1, 2, ... per window; 0 = padding)."""
    tokens = np.zeros((count, width), np.int32)
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (count, width)).copy()
    segments = np.zeros((count, width), np.int32)
    for r, row in enumerate(rows):
        start = 0
        for s, w in enumerate(row, start=1):
            tokens[r, start: start + len(w)] = w
            positions[r, start: start + len(w)] = np.arange(len(w))
            segments[r, start: start + len(w)] = s
            start += len(w)
    return tokens, positions, segments


def layer_similarity(model: Model, documents_ids: Sequence[Sequence[int]], *, max_length: int = 512,
                     batch_size: int = 8, swiftkv: bool = False,
                     progress: Optional[Callable[[int], None]] = None) -> dict:
    """Mean cosine similarity between the residual stream at every pair of depths, over all tokens.

    Documents (lists of token ids) are cut into windows of max_length tokens, each its own context (positions
    from 0), packed several to a row with segment ids and padded; padding is excluded. Returns float64 numpy
    arrays: similarity [L + 1, L + 1] (depth 0 = embeddings, i = output of layer i - 1), adjacent [L] (layer i's
    input vs its output), to_final [L + 1] (every depth vs the last), mean_norm [L + 1]; and the counts.
    swiftkv=False: the teacher wiring (the observation is about the original model); True: the SwiftKV one.
    progress(n) is called with the tokens of each batch.
    """
    cfg = model.config
    if max_length < 1 or batch_size < 1:
        raise ValueError(f"max_length and batch_size must be >= 1, got {max_length}, {batch_size}")
    if swiftkv and not cfg.is_swiftkv:
        raise ValueError("swiftkv=True needs a SwiftKV model (num_key_value_layers < num_hidden_layers)")
    windows = _windows(documents_ids, max_length, cfg.vocab_size)
    if not windows:
        raise ValueError("no documents to analyse")
    rows = _pack(windows, max_length)
    width = padded_length(max(sum(map(len, row)) for row in rows), None)
    depths = cfg.num_hidden_layers + 1
    gram, norm_sum, tokens = np.zeros((depths, depths)), np.zeros(depths), 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start: start + batch_size]
        count = min(1 << (len(chunk) - 1).bit_length(), batch_size)  # a power of two: few compiles
        ids, positions, segments = _row_arrays(chunk, width, count)
        _, inter = intermediates(model, ids, swiftkv=bool(swiftkv), positions=positions, segment_ids=segments)
        g, n, c = jax.device_get(_batch_sums(inter["residual"], jnp.asarray(segments)))
        gram += np.asarray(g, np.float64)
        norm_sum += np.asarray(n, np.float64)
        tokens += int(c)
        if progress:
            progress(int(c))
    similarity = gram / tokens
    return {"num_layers": cfg.num_hidden_layers, "tokens": tokens, "documents": len(documents_ids),
            "windows": len(windows), "max_length": max_length, "swiftkv": bool(swiftkv),
            "similarity": similarity, "adjacent": np.diagonal(similarity, 1).copy(),
            "to_final": similarity[:, -1].copy(), "mean_norm": norm_sum / tokens}


def _name(result: dict) -> str:
    model = result.get("model")
    return model_label(model) if model else "model"


def plot_similarity(result: dict, path) -> Path:
    """One PNG: the [depth, depth] similarity heatmap, and cos(input, output) of each layer (plus every depth
    against the last) as lines."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    sim = np.asarray(result["similarity"])
    adjacent, to_final = np.asarray(result["adjacent"]), np.asarray(result["to_final"])
    depths = sim.shape[0]
    fig, (heat, lines) = plt.subplots(1, 2, figsize=(13, 5.5), dpi=120)
    image = heat.imshow(sim, origin="lower", cmap="viridis", vmin=min(0.0, float(sim.min())), vmax=1.0,
                        interpolation="nearest")
    fig.colorbar(image, ax=heat, label="mean cosine similarity")
    heat.set_xlabel("depth j (0 = embeddings, i = output of layer i-1)")
    heat.set_ylabel("depth i")
    heat.set_title("cos(h_i, h_j)")
    lines.plot(np.arange(depths - 1), adjacent, marker="o", ms=3, label="cos(input, output) of layer i")
    lines.plot(np.arange(depths), to_final, marker=".", ms=3, alpha=0.7,
               label=f"cos(h_i, h_{depths - 1}) (last layer's output)")
    lines.axhline(0.9, color="grey", ls="--", lw=0.8)
    lines.set_xlabel("layer i / depth i")
    lines.set_ylabel("mean cosine similarity")
    lines.set_ylim(min(0.0, float(min(adjacent.min(), to_final.min()))) - 0.02, 1.02)
    lines.grid(True, alpha=0.3)
    lines.legend(loc="lower right")
    wiring = "SwiftKV" if result.get("swiftkv") else "teacher"
    fig.suptitle(f"{_name(result)}: residual-stream cosine similarity over {result['tokens']} tokens ({wiring} wiring)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def _jsonable(result: dict) -> dict:
    return {k: np.asarray(v).tolist() if k in ARRAYS else v for k, v in result.items()}


def default_out_dir(model_dir) -> Path:
    """./analysis/<model basename>: never inside the checkpoint."""
    return Path("analysis") / model_label(model_dir)


def analyze(model_dir, data_source: str, *, max_tokens: int = 8192, max_length: int = 512, out_dir=None,
            tokenizer_dir=None, dtype=None, batch_size: int = 8, swiftkv: bool = False,
            cache_dir: Optional[str] = None, progress: Optional[Callable[[int], None]] = None,
            names: Optional[dict] = None) -> dict:
    """layer_similarity of the checkpoint in model_dir on the first max_tokens tokens of data_source.

    data_source: as `perplexity=SOURCE` of the eval tasks (a .txt file, folder glob of .txt, jsonl/parquet with
    'text'); documents are tokenised as the tokenizer does by default (BOS included) until max_tokens, the last
    one cut. Writes similarity.json and similarity.png into out_dir (default ./analysis/<model basename>).
    names: what errors call data_source and out_dir (the CLI's flags; default the parameters' names).
    """
    import swiftkv_jax as sk
    from swiftkv_jax.data.chat import load_tokenizer
    from swiftkv_jax.evaluation.report import check_output_folder
    from swiftkv_jax.evaluation.tasks import read_documents

    names = {"data_source": "data_source", "out_dir": "out_dir", **(names or {})}
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out = Path(out_dir) if out_dir is not None else default_out_dir(model_dir)
    check_output_folder(out, names["out_dir"])  # a bad output folder or source fails before loading weights
    where, texts = read_documents(data_source, label=names["data_source"], cache_dir=cache_dir)
    tokenizer = load_tokenizer(str(tokenizer_dir or model_dir))
    documents = []
    left = max_tokens
    for text in texts:
        ids = tokenizer(text)["input_ids"][:left]
        if ids:
            documents.append(ids)
            left -= len(ids)
        if left <= 0:
            break
    if not documents:
        raise ValueError(f"{data_source}: the documents tokenise to no tokens")
    model = sk.load(str(model_dir), dtype)
    result = {"model": str(model_dir), "data": where}
    result.update(layer_similarity(model, documents, max_length=max_length, batch_size=batch_size, swiftkv=swiftkv,
                                   progress=progress))
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / JSON_FILE, _jsonable(result), indent=1)
    plot_similarity(result, out / PLOT_FILE)
    result["out_dir"] = str(out)
    return result


def first_similar_layer(adjacent, threshold: float = 0.9) -> Optional[int]:
    """The first layer k such that every layer from k to the last has cos(input, output) >= threshold."""
    adjacent = np.asarray(adjacent)
    below = np.nonzero(adjacent < threshold)[0]
    if len(below) == 0:
        return 0
    return None if below[-1] == len(adjacent) - 1 else int(below[-1]) + 1


def format_summary(result: dict, threshold: float = 0.9) -> str:
    """A short table: per layer cos(input, output), cos(input, last output), mean |input|; then the depths
    from which the layers change the residual stream little."""
    sim = np.asarray(result["similarity"])
    adjacent, to_final, norm = (np.asarray(result[k]) for k in ("adjacent", "to_final", "mean_norm"))
    layers = len(adjacent)
    wiring = "SwiftKV" if result.get("swiftkv") else "teacher"
    lines = [f"{_name(result)}: residual-stream cosine similarity over {result['tokens']} tokens "
             f"({result['documents']} documents, windows of {result['max_length']}, {wiring} wiring)",
             "layer  cos(in, out)  cos(in, final)  mean |in|"]
    lines += [f"{i:5d}  {adjacent[i]:12.4f}  {to_final[i]:14.4f}  {norm[i]:9.3g}" for i in range(layers)]
    lines.append(f"final  {'':12s}  {to_final[-1]:14.4f}  {norm[-1]:9.3g}")
    above = int(np.sum(adjacent >= threshold))
    lines.append(f"{above} of {layers} layers have cos(input, output) >= {threshold}; "
                 f"lowest {adjacent.min():.4f} at layer {int(adjacent.argmin())}")
    k = first_similar_layer(adjacent, threshold)
    but_last = first_similar_layer(adjacent[:-1], threshold) if layers > 1 else None
    if k is not None:
        lines.append(f"from layer {k} on, every layer has cos(input, output) >= {threshold}")
    elif but_last is not None:  # the last layer often rewrites the stream for the head
        lines.append(f"layers {but_last} to {layers - 2} all have cos(input, output) >= {threshold}; "
                     f"the last layer {adjacent[-1]:.4f}")
    else:
        lines.append(f"no run of layers up to the last (or last but one) has cos(input, output) >= {threshold}")
    half = layers // 2
    if 0 < half < layers - 1:
        lines.append(f"input of layer {half} (SwiftKV l = L/2) vs input of the last layer: "
                     f"cos {sim[half, layers - 1]:.4f}")
    return "\n".join(lines)
