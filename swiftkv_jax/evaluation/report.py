"""The eval table (one row per task and metric, a column per model, and the delta of two) and its JSON."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from swiftkv_jax.checkpoints.atomic import write_text_atomic

TABLE_METRICS = {"multiple_choice": ("acc", "acc_norm"),
                 "generation": ("exact_match", "exact_match_flexible"),  # lm-eval's strict-match, flexible-extract
                 "perplexity": ("perplexity", "bits_per_byte", "nats_per_token")}


def model_label(path) -> str:
    """A checkpoint's name in tables, titles and folders: its directory's base name."""
    return os.path.basename(os.path.normpath(str(path))) or "model"


def write_json(path, data, *, indent: int = 2) -> None:
    """Write whole or not at all: a crash mid-write leaves any earlier file intact, and no temporary file."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data, indent=indent, default=str) + "\n")


def check_output_file(path, flag: str) -> None:
    """Refuse, before any work, an output file that could not be written at the end: a folder in its place, or a
    parent that is a file or not writable (a run of minutes must not end in IsADirectoryError)."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder: give a file path, e.g. {os.path.join(path, 'results.json')}")
    _check_creatable(os.path.dirname(os.path.abspath(path)), flag, path)


def check_output_folder(path, flag: str) -> None:
    """Refuse, before any work, an output folder that could not be made or written: a file in its place, or an
    ancestor that is a file or not writable. The folder itself is made when the results are written."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path} exists and is not a folder: give a folder (it is made if missing)")
    _check_creatable(path, flag, path)


def _check_creatable(folder, flag: str, path) -> None:
    """`folder` exists or can be made: its nearest existing ancestor is a writable folder."""
    ancestor = os.path.abspath(folder)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(f"{flag} {path}: {ancestor} is a file, not a folder: choose another {flag}")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {ancestor} is not writable: choose another {flag}")


def _cell(metrics: dict, name: str) -> str:
    value, err = metrics[name], metrics.get(f"{name}_stderr")
    return f"{value:.4f} ± {err:.4f}" if err is not None and err == err else f"{value:.4f}"


def comparison_table(tasks, results: dict) -> str:
    """results: {model path: {task key: metrics}}. With two models the last column is first - second."""
    paths = list(results)
    header = (["task", "n-shot", "metric", "n"] + [model_label(p) for p in paths]
              + (["Δ (model − compare)"] if len(paths) == 2 else []))
    rows = []
    for task in tasks:
        for metric in TABLE_METRICS[task.kind]:
            row = [task.key, str(task.num_fewshot), metric, str(results[paths[0]][task.key]["n"])]
            row += [_cell(results[p][task.key], metric) for p in paths]
            if len(paths) == 2:
                a, b = (results[p][task.key][metric] for p in paths)
                row.append(f"{a - b:+.4f}")
            rows.append(row)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def results_json(args, tasks, results: dict) -> dict:
    paths = list(results)
    out = {"command": sys.argv, "options": {k: v for k, v in vars(args).items() if k != "command"},
           "tasks": {t.key: {"kind": t.kind, "source": t.source, "num_fewshot": t.num_fewshot,
                             "n": len(t.items)} for t in tasks},
           "results": results}
    if len(paths) == 2:
        out["deltas"] = {t.key: {m: results[paths[0]][t.key][m] - results[paths[1]][t.key][m]
                                  for m in TABLE_METRICS[t.kind]} for t in tasks}
    return out
