"""Tokens -> text as they come, with OpenAI's stop strings.

Each token is decoded with the few tokens before it (vLLM's incremental detokenization): the
new text is what `decode(ids[prefix:])` adds to `decode(ids[prefix:read])`, where `read` is the
end of the ids already turned into text and `prefix` the start of the one before (a token's text
may depend on its left neighbour, e.g. SentencePiece's leading space). A token that ends inside a
UTF-8 character adds nothing until the character is whole. So a token costs a decode of a few
ids, never of the whole answer.

A stop string may span tokens, so what is handed out is held back while it could still become
(the start of) a stop string. The answer ends just before the first stop string; the stop string
itself is never shown.
"""

from __future__ import annotations

from collections.abc import Sequence


class Detokenizer:
    """`add(token)` -> the new text safe to show; `stopped` once a stop string appeared;
    `flush()` -> the text held back, when the tokens end without one."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self._prefix = self._read = 0  # ids[:_read] are in `decoded`; ids[_prefix:] decode next
        self.decoded = ""  # the text of ids[:_read]
        self.shown = 0  # characters of `decoded` handed out
        self.text = ""  # the answer as shown so far (up to a stop string once stopped)
        self.stopped = False

    def add(self, token: int) -> str:
        """The text that `token` completes (may be ""); nothing after a stop string."""
        if self.stopped:
            raise RuntimeError("add after a stop string")
        self.ids.append(int(token))
        new = self._new_text(final=False)
        return "" if new is None else self._append(new, final=False)

    def flush(self) -> str:
        """What was held back (the tokens ended without completing a stop string); an
        unfinished character at the end shows as U+FFFD."""
        if self.stopped:
            return ""
        return self._append(self._new_text(final=True), final=True)

    def _new_text(self, *, final: bool) -> str | None:
        """The text of the ids after _read, or None while it ends inside a character."""
        ids, tok = self.ids, self.tokenizer
        before = tok.decode(ids[self._prefix : self._read])
        after = tok.decode(ids[self._prefix :])
        if after.endswith("\ufffd") and not final:
            return None
        self._prefix, self._read = self._read, len(ids)
        return after[len(before) :]

    def _append(self, new: str, *, final: bool) -> str:
        """`new` added to the text; returns the part that is safe to show."""
        start = max(0, len(self.decoded) - max((len(s) for s in self.stop), default=0) + 1)
        self.decoded += new
        found = [i for i in (self.decoded.find(s, start) for s in self.stop) if i >= 0]
        if found:
            self.stopped = True
            return self._show(min(found))
        held = 0 if final else self._partial_stop(self.decoded)
        return self._show(len(self.decoded) - held)

    def _partial_stop(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        return max(
            (n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0
        )

    def _show(self, end: int) -> str:
        """Hands out decoded[shown:end]."""
        new = self.decoded[self.shown : end]
        self.shown = max(self.shown, end)
        self.text += new
        return new
