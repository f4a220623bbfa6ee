"""rollout_lab."""
