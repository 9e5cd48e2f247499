"""The demo's distillation recipe at 50% under other settings: the share of the undistilled student's held-out
loss gap to the teacher that each distilled student closes.

    python benchmarks/recipe_sweep.py OUT [--budget full|quick|gpu|smoke] [--arch key=N,...] [--out JSON] ROW ...

ROW: 'NAME|STEPS|key=value;key=value' (STEPS empty: the budget's; the overrides go after the budget's own, so a
row changes only what it names). OUT: a demo's --out of that budget (`demo.py --budget B --out OUT`), whose corpus
and teacher are used; a missing teacher is pretrained there first, as the demo does (its settings recorded).
--arch: the teacher's architecture keys changed (e.g. twice the width), for how a recipe's best rate moves with the
model. Each row distils the 50% student into OUT/distill/exp-NAME (kept: a row run again is only re-scored; a NAME
given other STEPS or overrides is refused) and is written to --out as soon as it is scored.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from results_file import RawDescriptionDefaultsFormatter, write_results


def parse_row(text: str) -> tuple[str, int | None, tuple]:
    """'NAME|STEPS|k=v;k=v' -> (name, steps or None, overrides)."""
    parts = text.split("|")
    if len(parts) != 3 or not parts[0]:
        raise ValueError(f"row {text!r}: write it NAME|STEPS|key=value;key=value (STEPS or the overrides may be "
                         f"empty, e.g. 'lr4e-3||optim.learning_rate=4e-3')")
    name, steps, overrides = parts
    if "/" in name or name in (".", ".."):
        raise ValueError(f"row {text!r}: NAME names the student's folder (distill/exp-NAME): no '/'")
    if steps and not (steps.isdigit() and int(steps) > 0):
        raise ValueError(f"row {text!r}: STEPS must be a positive whole number or empty, got {steps!r}")
    return name, int(steps) if steps else None, tuple(o for o in overrides.split(";") if o)


def row_settings(base, steps: int | None, overrides: tuple):
    """The budget's settings distilling for `steps` (None: its own) with `overrides` after its own."""
    return dataclasses.replace(base, distill_steps=steps or base.distill_steps,
                               distill_overrides=base.distill_overrides + overrides)


def parse_arch(text: str) -> dict:
    try:
        return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}
    except ValueError:
        raise ValueError(f"--arch {text!r}: write it key=N,key=N "
                         "(e.g. hidden_size=256,num_attention_heads=8)") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=RawDescriptionDefaultsFormatter)
    p.add_argument("work", type=Path, help="the demo's --out (its corpus and teacher; made there if missing)")
    p.add_argument("rows", nargs="+", help="NAME|STEPS|key=value;key=value (STEPS empty: the budget's)")
    p.add_argument("--budget", default="full", choices=("full", "quick", "gpu", "smoke"),
                   help="the demo's settings (swiftkv_jax.demo.SETTINGS); OUT's demo must be of the same")
    p.add_argument("--arch", default=None, help="the teacher's architecture keys changed: key=N,... (default: none)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON of the rows, rewritten after each (default: none, the table is printed only)")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        rows = [parse_row(r) for r in args.rows]
        arch = parse_arch(args.arch) if args.arch else {}
    except ValueError as e:
        p.error(str(e))

    from transformers import AutoTokenizer

    import swiftkv_jax as sk
    from swiftkv_jax import demo
    from swiftkv_jax.evaluation.quality import held_out_scores

    made = args.work / "demo_settings.json"
    if made.is_file() and (budget := json.loads(made.read_text())["settings"]) != args.budget:
        p.error(f"{args.work} holds a demo of the {budget} budget (see {made}): pass --budget {budget}")
    try:
        demo.check_device(args.budget)
    except ValueError as e:
        p.error(str(e))
    base = demo.SETTINGS[args.budget]
    if unknown := set(arch) - set(base.architecture):
        p.error(f"--arch: {', '.join(sorted(unknown))} is not an architecture key of the demo's teacher; those are "
                f"{', '.join(base.architecture)}")
    base = dataclasses.replace(base, architecture={**base.architecture, **arch})
    teacher_dir = args.work / "teacher" / "model_hf"
    if teacher_dir.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(args.work / "corpus" / "tokenizer")
    else:  # made as the demo makes it, its settings recorded: a later demo.py there reuses the teacher
        record = demo.settings_record(args.budget, base)
        try:
            demo.record_settings(args.work, record, demo.check_out(args.work, record))
        except ValueError as e:
            p.error(str(e))
        _, tokenizer = demo.build_data(args.work, base, replace=not demo.trained(args.work))
        demo.pretrain(args.work, base, demo.teacher_init(args.work, base, tokenizer))
    teacher = sk.load(teacher_dir)
    if arch and any(getattr(teacher.config, k) != v for k, v in arch.items()):
        raise SystemExit(f"{teacher_dir} is not of --arch {args.arch}: give another OUT")
    batches, _ = demo.held_out(args.work, base, tokenizer)
    t = held_out_scores(teacher, teacher, batches)["val_loss"]
    l = teacher.config.num_hidden_layers // 2  # the 50% student
    u = held_out_scores(teacher, sk.to_swiftkv(teacher, l, 1), batches)["val_loss"]
    print(f"teacher {t:.4f}, undistilled 50% student {u:.4f} (val loss, nats/token)", flush=True)
    payload = {"budget": args.budget, "arch": arch, "teacher_val_loss": t, "undistilled_val_loss": u, "rows": []}
    for name, steps, overrides in rows:
        settings = row_settings(base, steps, overrides)
        try:
            student = sk.load(demo.distill(args.work, settings, teacher_dir, demo.Variant(f"exp-{name}", l)))
        except ValueError as e:  # e.g. a kept student of this name trained with other settings
            raise SystemExit(f"row {name}: {e}") from None
        s = held_out_scores(teacher, student, batches)["val_loss"]
        payload["rows"].append(dict(name=name, steps=settings.distill_steps, overrides=list(overrides), val_loss=s,
                                    gap_closed=(u - s) / (u - t) if u > t else math.nan))
        if args.out:
            write_results(args.out, "benchmarks/recipe_sweep.py", argv, payload, quiet=True)
    print("\n| row | steps | overrides | val loss | gap closed |\n|---|---:|---|---:|---:|")
    for r in payload["rows"]:
        print(f"| {r['name']} | {r['steps']} | {'; '.join(r['overrides'])} | {r['val_loss']:.4f} | "
              f"{r['gap_closed']:.1%} |")
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
