"""Incremental detokenization with stop strings, for the engine front.

Each request gets an `IncrementalDetokenizer`. As its token ids arrive, `step` returns the new text to
stream and whether a stop string matched:

* Text is decoded from a sliding window of ids (vLLM's prefix-offset / read-offset technique): the ids of
  the previous emission give the context, the ids after `read_offset` the new text, which is
  decode(window) minus decode(context). A step costs O(window), and tokenizers that drop a leading space
  when a piece is decoded alone (SentencePiece) decode the same as in context. The window starts with the
  last few prompt ids, so the first output token is decoded in context too.
* A character split across tokens (byte-level BPE) decodes to U+FFFD until its last byte arrives; such
  text is not emitted until it is complete.
* Stop strings are matched on the decoded text, across token boundaries. On a match the output ends right
  before it (`stop_reason` = the string). Text that could still be the start of a stop string is held
  back until resolved, so a streamed delta never contains any part of a stop string; `finish` releases it
  when the request ends for another reason.
* A final stop token (EOS unless ignore_eos, or one of stop_token_ids) is not part of the text, even with
  skip_special_tokens=False (as in vLLM).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from bullet_ray.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_INCOMPLETE = "\ufffd"  # what a partial UTF-8 sequence decodes to
# prompt ids that seed the decode window (enough for any tokenizer's leading-space / merge context)
NUM_PROMPT_CONTEXT_TOKENS = 5


class TokenIdText:
    """The text of a model without a tokenizer (dummy weights): each token id as " <id>".

    So streams of such models still carry one text delta per token (clients, and benchmarks measuring
    inter-token latency, see every token), and stop strings and usage work as with a real vocabulary.
    """

    eos_token_id = None

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return "".join(f" <{int(i)}>" for i in ids)


class IncrementalDetokenizer:
    """Turns a request's growing output ids into text deltas and detects its stop strings.

    `eos_token_ids`: the model's EOS ids (default: the tokenizer's eos_token_id); a final EOS or stop
    token is left out of the text. After a stop-string match the detokenizer is finished: further steps
    return ("", True).
    """

    def __init__(self, tokenizer: Any, params: SamplingParams, prompt_token_ids: Sequence[int],
                 eos_token_ids: Sequence[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.params = params
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = () if eos is None else (eos,)
        self.eos_token_ids = tuple(eos_token_ids)
        context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_INCOMPLETE):
            context = []  # the prompt ends inside a character: decode the output on its own
        self._ids: list[int] = context  # the decode window's ids: prompt context + output ids
        self._prefix_offset = 0  # window[prefix_offset:read_offset] = context of the next decode
        self._read_offset = len(context)  # ids after this are not yet in _text
        self._text = ""  # output text decoded so far (stop-string match: truncated before it)
        self._num_emitted_chars = 0  # characters of _text already returned
        self._stops = tuple(params.stop)
        self._max_stop_chars = max((len(s) for s in self._stops), default=0)
        self.stop_reason: str | None = None  # the stop string that matched
        self.is_finished = False

    @property
    def text(self) -> str:
        """The output text returned so far (concatenation of every delta)."""
        return self._text[:self._num_emitted_chars]

    def step(self, new_token_ids: Sequence[int]) -> tuple[str, bool]:
        """Add generated ids; return (text safe to emit now, whether a stop string matched)."""
        if self.is_finished:
            return "", self.stop_reason is not None
        ids = list(new_token_ids)
        for i, token in enumerate(ids):
            if self.params.is_stop_token(token, self.eos_token_ids):
                ids = ids[:i]  # generation ends with this token; it is not text
                break
        self._ids.extend(ids)
        self._advance(flush=False)
        return self._release()

    def finish(self) -> str:
        """At the end of the request: the rest of the text (incomplete characters and held-back text)."""
        if self.is_finished:
            return ""
        self._advance(flush=True)
        delta, _ = self._release()
        self.is_finished = True
        return delta + self._take(len(self._text))

    # internals ------------------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _advance(self, flush: bool) -> None:
        """Move the window's complete new text into _text (with flush: incomplete characters too)."""
        if self._read_offset == len(self._ids):
            return
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and (flush or not full.endswith(_INCOMPLETE)):
            if not full.startswith(prefix):
                logger.debug("window decode %r does not extend its context %r", full, prefix)
            self._text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def _release(self) -> tuple[str, bool]:
        """Check stop strings in the new text; return what may be emitted and whether one matched."""
        if not self._stops:
            return self._take(len(self._text)), False
        start = max(0, self._num_emitted_chars - self._max_stop_chars)
        hit_at, hit = -1, None
        for stop in self._stops:
            pos = self._text.find(stop, start)
            if pos != -1 and (hit is None or pos < hit_at):
                hit_at, hit = pos, stop
        if hit is not None:
            self.stop_reason = hit
            self.is_finished = True
            self._text = self._text[:hit_at]
            return self._take(hit_at), True
        return self._take(len(self._text) - self._num_held_back_chars()), False

    def _num_held_back_chars(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        tail = self._text[-self._max_stop_chars:]
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(tail)), longest, -1):
                if tail.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _take(self, end: int) -> str:
        end = max(end, self._num_emitted_chars)
        delta = self._text[self._num_emitted_chars:end]
        self._num_emitted_chars = end
        return delta
