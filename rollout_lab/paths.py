"""Where things live: every notebook and script takes its paths from here."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"
RESULTS = DATA / "results"
CALIBRATION = DATA / "calibration"
PROMPT_LENGTHS = DATA / "prompt_lengths"
TABLES = DATA / "tables"
FIGURES = ROOT / "figures"
NOTEBOOKS = ROOT / "notebooks"
BUILD = ROOT / "build"
