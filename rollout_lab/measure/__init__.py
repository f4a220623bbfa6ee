"""The measure layer: what we run the engine on and what we record about it.

models and presets (tiny, preset, local checkpoint), workloads (prompt lengths, shipped CSVs,
distributions), calibrate (grid, probes, provenance check), sweep (runner and records), peers (HF
generate, generate_batch), provenance, the benchmarks behind ``rollout-lab bench`` (rl, grpo,
decode_step, prefill_routes, fidelity, long_tail), and the studies behind the notebooks:
bucket_choices (02), adaptation (04), makespans (sharding).

May import: ``rollout_lab.engine``, ``planner``, ``workspace``. Never ``rollout_lab.plots``.
"""
