"""Benchmarks and their helpers: ``tandem bench`` (bench, bench_baselines, heal_bench,
worker_bench) and the ones run as ``python -m app.benchmarks.NAME`` (load_bench,
parallel_bench, json_prompts), with what they start beside the app (background_load, a
loopback worker, a latency proxy). Nothing in the chat app or the API server imports them."""
