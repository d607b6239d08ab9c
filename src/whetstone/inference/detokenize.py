"""Text of a growing token sequence, produced incrementally, with stop strings cut out.

Byte-level BPE tokens can end in the middle of a UTF-8 character, so a token's text is only
known once the next ones arrive. We decode a short window of recent tokens and release text only
when it no longer ends in a replacement character; a stop string already whole before that
character ends the text at once (its token is the last). Text that could be the start of a stop
string is held back until it is known not to be one, so a stream never shows part of a stop
string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class IncrementalText:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are fully decoded into self.text
        self._read = 0  # tokens before this are in self.text
        self.text = ""
        """All text decoded so far (never includes a stop string)."""
        self.released = 0
        """How many characters of `text` are safe to show (no pending stop-string prefix)."""
        self.stopped = False

    def push(self, ids: list[int]) -> None:
        """Add generated tokens; sets `stopped` once a stop string appears (and cuts it)."""
        if self.stopped:
            return
        self._ids.extend(ids)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before):
            return
        if after.endswith("\ufffd"):  # an incomplete character: wait for more bytes, unless a
            self._stop_before(after[len(before) :].rstrip("\ufffd"))  # stop string ends before it
            return
        search_from = self._search_from()
        held = len(self.text) - self.released
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._cut_stop(search_from)
        if self.stopped:
            self.released = len(self.text)
        else:
            self.released = len(self.text) - self._pending_stop_prefix(held + len(after) - len(before))

    def finish(self) -> None:
        """No more tokens: release everything (an incomplete trailing character included)."""
        if not self.stopped:
            before = self._decode(self._ids[self._prefix : self._read])
            after = self._decode(self._ids[self._prefix :])
            if len(after) > len(before):
                search_from = self._search_from()
                self.text += after[len(before) :]
                self._cut_stop(search_from)
        self.released = len(self.text)

    def _search_from(self) -> int:
        """Where a stop string that ends in text yet to come may start in `text`."""
        return max(0, len(self.text) - max((len(s) for s in self._stop), default=0))

    def _stop_before(self, whole: str) -> None:
        """Stop if a stop string ends in `whole`, the characters completed before an incomplete
        one (a token can end part-way through a character): the stop string is there whatever
        bytes come next, so generation ends at this token, not one later."""
        if not self._stop or not whole:
            return
        start = self._search_from()
        tail = self.text[start:] + whole
        hits = [i for i in (tail.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[:start] + tail[: min(hits)]
            self.released = len(self.text)
            self.stopped = True

    def _cut_stop(self, search_from: int) -> None:
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _pending_stop_prefix(self, most: int) -> int:
        """Length of the longest tail of `text` that starts some stop string, known to be at most
        `most`: what was held back before the last push plus the characters it added (a longer
        tail would have left a longer one held back before). So a push tries the sizes its own
        characters can have made, and a generation, in all, about as many sizes as characters:
        the work per token does not grow with the stop strings' length."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(self.text), most), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
