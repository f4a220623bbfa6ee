"""The engine layer: ``Rollout`` over a Hugging Face causal LM, and everything a call runs.

Rooms, top to bottom (each imports only rooms below it; ``figures/engine.png`` draws them from the code):
``distributed`` (data-parallel rollout) <- ``api/`` (``Rollout``, ``RolloutConfig``, the call spec,
the result, the costs) <- ``sched/`` (a ``Request`` per row; the aligned and paged schedulers, HF
generate) <- ``runner/`` (the model runner: prefill, the decode step, its graphs and compile) <-
``trainer`` <- ``kv/`` (the caches and their sizing) <- ``sample/`` (``SamplingParams``, penalties,
the sampler, stop strings) and ``kernels/`` (the one door to the attention kernels) <- ``profile``,
``limits`` (every size against the context and the device's memory), ``model_info``.

May import: torch, transformers, ``rollout_lab.planner``, ``rollout_lab.workspace``. Never
``rollout_lab.measure`` or ``plots``.
"""
