"""What a user sees of a run: metrics.jsonl, a progress bar, and the loss curves as a PNG."""

from __future__ import annotations

import json
from pathlib import Path

from swiftkv_jax.checkpoints.atomic import write_text_atomic

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


class MetricsLog:
    """Appends one JSON record per logged step; on resume drops records past the restored step."""

    def __init__(self, output_dir, resume_step: int = 0):
        self.path = Path(output_dir) / METRICS_FILE
        kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step] if resume_step else []
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))  # a kill keeps the history

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path) -> list[dict]:
    """The records; an unfinished last line (a full disk or a kill mid-append) is left out, damage elsewhere raises."""
    path = Path(path)
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        try:
            json.loads(lines[-1])
        except ValueError:
            lines.pop()
    return [json.loads(line) for line in lines if line.strip()]


def plot_losses(records: list[dict], path, title: str = "") -> Path:
    """loss, T^2-scaled KL and hidden MSE against step, log-scaled, one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for key in ("loss", "kl", "hidden_mse"):
        values = [r[key] for r in records if key in r]
        if any(v > 0 for v in values):
            ax.plot(steps[: len(values)], values, label=key)
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
