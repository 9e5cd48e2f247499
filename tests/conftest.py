"""Test setup: 8 fake CPU devices for sharding tests, fp32, and no hub access."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import jax  # noqa: E402  (after XLA_FLAGS)

jax.config.update("jax_default_matmul_precision", "highest")
