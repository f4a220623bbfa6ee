"""The planner layer: what a rollout should do, priced by the cost model. Pure Python and numpy.

cost (C(B, L) and the geometry) <- bucket_dp (the exact DP, its oracle, the k-bucket DP) <- chunks
<- routes (nocb vs bucketed, shared prefill) <- sharding; decode_steps (the EOS-aware step estimate
and the response-length prior) and fit (NNLS, the calibration fit, the online refit) beside them.

May import: the standard library, numpy, ``rollout_lab.workspace``. Never torch, and never
``rollout_lab.engine``, ``measure`` or ``plots`` (``tests/test_layers.py`` checks both).
"""
