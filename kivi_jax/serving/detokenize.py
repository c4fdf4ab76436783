"""Tokens -> text as they come, with OpenAI's stop strings.

A stop string may span tokens, and a token may end inside a UTF-8 character, so the text is the
decoding of every token so far, and what is handed out is held back while it could still become
(the start of) a stop string or ends in an incomplete character. The answer ends just before the
first stop string; the stop string itself is never shown.
"""

from __future__ import annotations

from collections.abc import Sequence


class Detokenizer:
    """`add(token)` -> the new text safe to show; `stopped` once a stop string appeared;
    `flush()` -> the text held back, when the tokens end without one."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.shown = 0  # characters of the decoded text handed out
        self.text = ""  # the answer as shown so far (up to a stop string once stopped)
        self.stopped = False

    def add(self, token: int) -> str:
        """The text that `token` completes (may be ""); nothing after a stop string."""
        if self.stopped:
            raise RuntimeError("add after a stop string")
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids)
        # A stop string starts no earlier than its length before the text not yet shown.
        start = max(0, self.shown - max((len(s) for s in self.stop), default=0))
        found = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if found:
            self.stopped = True
            return self._show(text[: min(found)])
        if text.endswith("\ufffd"):  # a character cut between tokens: wait for the rest
            return ""
        return self._show(text[: len(text) - self._partial_stop(text)])

    def flush(self) -> str:
        """What was held back (the tokens ended without completing a stop string)."""
        return "" if self.stopped else self._show(self.tokenizer.decode(self.ids))

    def _partial_stop(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        return max(
            (n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0
        )

    def _show(self, text: str) -> str:
        new = text[self.shown :]
        self.shown = max(self.shown, len(text))
        self.text += new
        return new
