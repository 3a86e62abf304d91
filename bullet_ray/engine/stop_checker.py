"""Incremental detokenization with stop strings, for the engine front.

Text is decoded from a sliding window of token ids (the tokens of the previous emission plus the new
ones), so a step costs O(window) and
a multi-byte character split across tokens is emitted only once complete. Text that could be the start
of a stop string is held back until it is resolved, so a streamed delta never contains any part of a
stop string; on a match the output ends right before it.
"""

from __future__ import annotations

from typing import Any

from bullet_ray.engine.sampling_params import SamplingParams

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # everything decoded so far
        self._emitted = 0  # characters of _text already returned
        self._stops = tuple(params.stop)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """The output text returned so far."""
        return self._text[:self._emitted]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _advance(self) -> None:
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(_INCOMPLETE):
            self._text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)

    def step(self, new_token_ids: list[int]) -> tuple[str, bool]:
        """Add tokens; return (text safe to emit now, whether a stop string matched)."""
        self.ids.extend(new_token_ids)
        self._advance()
        if not self._stops:
            return self._take(len(self._text)), False
        start = max(0, self._emitted - self._max_stop)
        hit_at, hit = -1, None
        for s in self._stops:
            pos = self._text.find(s, start)
            if pos != -1 and (hit_at == -1 or pos < hit_at):
                hit_at, hit = pos, s
        if hit is not None:
            self.stop_reason = hit
            self._text = self._text[:hit_at]
            return self._take(hit_at), True
        return self._take(len(self._text) - self._holdback()), False

    def _holdback(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        longest = 0
        tail = self._text[-self._max_stop:] if self._max_stop else ""
        for s in self._stops:
            for k in range(min(len(s) - 1, len(tail)), longest, -1):
                if tail.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        delta = self._text[self._emitted:end]
        self._emitted = end
        return delta

    def finish(self) -> str:
        """At the end of the request: the held-back text (no stop string matched)."""
        return self._take(len(self._text))
