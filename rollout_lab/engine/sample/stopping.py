"""Stop strings (vLLM's ``stop``): a row ends once its decoded text contains one of them.

Every route checks them the same way, on the host after each token of each live row
(``ContinuousBatcher._live_slots``, nocb's stopping criterion), so every route ends a row at the same
token: the one whose text completes the first stop string. The check decodes only the row's last
``max(len(stop)) + TAIL_SLACK_TOKENS`` tokens: a stop string of n characters that the newest token
completed spans at most n tokens of at least one character each, and the slack covers tokens that
decode to nothing (special tokens, the first bytes of a multi-byte character). A hit in that tail is
confirmed on the row's whole text, which the result's ``texts`` then cut before the stop string.

With ``min_new_tokens`` (per row, N) no stop string ends a row before its N-th token, and then only
one that ends past the text of its first N - 1 tokens (``floor``): one that token N or a later one
completed, as vLLM's ``min_tokens``; an earlier one neither ends the row nor cuts its text.

    stops = StopStrings(("\\n\\n", "###"), tokenizer)
    stops.hits([tokens_of_row_0, tokens_of_row_1])   # [False, True]: row 1 ends at its last token
    stops.cut("a\\n\\nb")                              # "a"

"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

TAIL_SLACK_TOKENS = 8  # tokens decoded beyond the longest stop string's characters


@dataclass(frozen=True)
class StopStrings:
    """A call's stop strings and the tokenizer that decodes rows (``skip_special_tokens=True``, as
    the result's ``texts``); checked by ``config.stop_conditions``."""

    strings: tuple[str, ...]
    tokenizer: Any

    def hits(self, rows: Sequence[Sequence[int]], min_new_tokens: Sequence[int] | None = None) -> list[bool]:
        """Per row (the tokens it generated so far, checked after each one), whether its text now
        contains a stop string; with ``min_new_tokens`` (per row), one that counts (``floor``)."""
        if not rows:
            return []
        minimum = [0] * len(rows) if min_new_tokens is None else list(min_new_tokens)
        tail = max(len(s) for s in self.strings) + TAIL_SLACK_TOKENS
        due = [i for i, row in enumerate(rows) if len(row) >= minimum[i]]
        found = [i for i, text in zip(due, self._decode([rows[i][-tail:] for i in due]))
                 if self.find(text) is not None]
        out = [False] * len(rows)
        for i, text in zip(found, self._decode([rows[i] for i in found]) if found else []):
            # the whole text: a tail can decode differently
            out[i] = self.find(text, self.floor(rows[i], minimum[i])) is not None
        return out

    def floor(self, tokens: Sequence[int], min_new_tokens: int) -> int:
        """The characters of the text of a row's first ``min_new_tokens - 1`` tokens: a stop string
        counts only where it ends past them (0 without a minimum)."""
        return len(self._decode([tokens[: min_new_tokens - 1]])[0]) if min_new_tokens > 1 else 0

    def find(self, text: str, floor: int = 0) -> int | None:
        """Where the earliest stop string in ``text`` that ends past character ``floor`` starts;
        None when it holds none."""
        starts = (text.find(s, max(0, floor - len(s) + 1)) for s in self.strings)
        return min((i for i in starts if i >= 0), default=None)

    def cut(self, text: str, floor: int = 0) -> str:
        """``text`` up to its first stop string past ``floor`` (vLLM's default: the stop string is
        not kept)."""
        start = self.find(text, floor)
        return text if start is None else text[:start]

    def _decode(self, rows: Sequence[Sequence[int]]) -> list[str]:
        return self.tokenizer.batch_decode([list(row) for row in rows], skip_special_tokens=True)


def stop_string_hits(stops: Sequence[StopStrings | None], rows: Sequence[Sequence[int]],
                     min_new_tokens: Sequence[int]) -> list[bool]:
    """Per row, whether its own stop strings (``stops``, None: none) end it now: rows that share a
    ``StopStrings`` are checked in one batch (``StopStrings.hits``)."""
    batches: dict[int, list[int]] = {}
    for i, row_stops in enumerate(stops):
        if row_stops is not None:
            batches.setdefault(id(row_stops), []).append(i)
    out = [False] * len(rows)
    for members in batches.values():
        hits = stops[members[0]].hits([rows[i] for i in members], [min_new_tokens[i] for i in members])
        for i, hit in zip(members, hits):
            out[i] = hit
    return out
