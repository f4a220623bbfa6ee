"""``python -m rollout_lab.cli ...``: the ``rollout-lab`` command (what the Makefile runs)."""
import sys

from rollout_lab.cli.main import main

sys.exit(main())
