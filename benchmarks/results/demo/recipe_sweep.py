"""Distil the 50% student of a finished full demo (its --out) under other recipes; print each one's share of the
undistilled student's validation-loss gap to the teacher that it closes.

    python benchmarks/results/demo/recipe_sweep.py OUT 'NAME|STEPS|key=value;key=value' ...
"""
import dataclasses
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

import swiftkv_jax as sk
from swiftkv_jax import demo
from swiftkv_jax.evaluation.quality import held_out_scores

out, recipes = Path(sys.argv[1]), sys.argv[2:]
base = demo.SETTINGS["full"]
teacher_dir = out / "teacher" / "model_hf"
teacher = sk.load(teacher_dir)
batches, _ = demo.held_out(out, base, AutoTokenizer.from_pretrained(out / "corpus" / "tokenizer"))
t = held_out_scores(teacher, teacher, batches)["val_loss"]
l = teacher.config.num_hidden_layers // 2  # the 50% student
u = held_out_scores(teacher, sk.to_swiftkv(teacher, l, 1), batches)["val_loss"]
print("teacher", t, "undistilled", u, flush=True)
for name, steps, overrides in (r.split("|") for r in recipes):
    settings = dataclasses.replace(base, distill_steps=int(steps),
                                   distill_overrides=tuple(overrides.split(";")) if overrides else ())
    student = sk.load(demo.distill(out, settings, teacher_dir, demo.Variant(f"exp-{name}", l)))
    s = held_out_scores(teacher, student, batches)["val_loss"]
    print(json.dumps(dict(name=name, steps=int(steps), overrides=settings.distill_overrides, val_loss=s,
                          gap_closed=(u - s) / (u - t))), flush=True)
