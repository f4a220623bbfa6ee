"""Stop strings (vLLM's ``stop``): a row ends once its decoded text contains one of them.

Every route checks them the same way, on the host after each token of each live row
(``ContinuousBatcher._live_slots``, nocb's stopping criterion), so every route ends a row at the same
token: the one whose text completes the first stop string. The check decodes only the row's last
``max(len(stop)) + TAIL_SLACK_TOKENS`` tokens: a stop string of n characters that the newest token
completed spans at most n tokens of at least one character each, and the slack covers tokens that
decode to nothing (special tokens, the first bytes of a multi-byte character). A hit in that tail is
confirmed on the row's whole text, which the result's ``texts`` then cut before the stop string.

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

    def hits(self, rows: Sequence[Sequence[int]]) -> list[bool]:
        """Per row (the tokens it generated so far, checked after each one), whether its text now
        contains a stop string."""
        if not rows:
            return []
        tail = max(len(s) for s in self.strings) + TAIL_SLACK_TOKENS
        found = [i for i, text in enumerate(self._decode([row[-tail:] for row in rows]))
                 if self.find(text) is not None]
        out = [False] * len(rows)
        for i, text in zip(found, self._decode([rows[i] for i in found]) if found else []):
            out[i] = self.find(text) is not None  # the whole text: a tail can decode differently
        return out

    def find(self, text: str) -> int | None:
        """Where the earliest stop string in ``text`` starts; None when it holds none."""
        return min((i for i in (text.find(s) for s in self.strings) if i >= 0), default=None)

    def cut(self, text: str) -> str:
        """``text`` up to its first stop string (vLLM's default: the stop string is not kept)."""
        start = self.find(text)
        return text if start is None else text[:start]

    def _decode(self, rows: Sequence[Sequence[int]]) -> list[str]:
        return self.tokenizer.batch_decode([list(row) for row in rows], skip_special_tokens=True)
