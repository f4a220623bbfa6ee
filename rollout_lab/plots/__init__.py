"""The plots layer: one module per figure family (calibration, buckets, latency, adaptation, grpo,
makespans), the interactive explorer, and the shared style. Draws records; measures nothing.

May import: matplotlib, ipywidgets, and every layer below (``measure``, ``engine``, ``planner``).
"""
