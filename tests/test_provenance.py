"""Provenance: the sha the sender names wins over a (possibly stale) .git; versions are recorded."""
from __future__ import annotations

from rollout_lab.measure.provenance import git_sha, provenance


def test_an_explicit_sha_wins(monkeypatch):
    monkeypatch.setenv("ROLLOUT_LAB_GIT_SHA", "abc123")
    assert git_sha() == "abc123"
    assert provenance()["git_sha"] == "abc123"


def test_without_it_the_checkout_is_read(monkeypatch):
    monkeypatch.delenv("ROLLOUT_LAB_GIT_SHA", raising=False)
    sha = git_sha()
    assert sha == "unknown" or len(sha.split("+")[0]) == 40
