"""The pieces of the OpenAI-compatible server (`swiftkv_jax.serving.server`): request parsing and errors
(`protocol`), incremental detokenization and stop strings (`text`), and the engine's step loop thread
(`engine_loop`)."""
