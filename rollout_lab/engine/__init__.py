"""The engine layer: ``Rollout`` over a Hugging Face causal LM, and everything a call runs.

config (RolloutConfig, RolloutResult, the route names) <- rollout (Rollout) <- batching (continuous
batching, chunked prefill) <- prefill, decode, steppers (eager and CUDA graph), cache, sampling,
stopping (stop strings), attention, nocb (HF generate), profile (profile and timing); distributed
(data-parallel rollout).

May import: torch, transformers, ``rollout_lab.planner``, ``rollout_lab.workspace``. Never
``rollout_lab.measure`` or ``plots``.
"""
