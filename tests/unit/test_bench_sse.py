"""SSE parsing and per-chunk accounting of the benchmark client, without a server."""

from __future__ import annotations

import json

from bullet_ray.bench.serve_bench import RequestRecord, SSEParser, _handle_event

STREAM = (b'data: {"choices": [{"text": "Hel"}]}\r\n\r\n'
          b": keep-alive comment\n\n"
          b'event: message\ndata: {"choices": [{"text": "lo"}]}\n\n'
          b'data: {"a":\ndata: 1}\n\n'
          b"data: [DONE]\n\n")
EVENTS = ['{"choices": [{"text": "Hel"}]}', '{"choices": [{"text": "lo"}]}', '{"a":\n1}', "[DONE]"]


def test_whole_stream():
    assert SSEParser().feed(STREAM) == EVENTS


def test_byte_by_byte_gives_the_same_events():
    parser = SSEParser()
    events = [e for i in range(len(STREAM)) for e in parser.feed(STREAM[i:i + 1])]
    assert events == EVENTS


def test_last_event_without_blank_line_comes_out_on_flush():
    parser = SSEParser()
    assert parser.feed(b'data: {"x": 1}') == []
    assert parser.flush() == ['{"x": 1}']
    assert parser.flush() == []


def test_multibyte_utf8_split_across_reads():
    raw = 'data: {"choices": [{"text": "é中"}]}\n\n'.encode()
    cut = raw.index("中".encode()) + 1  # in the middle of a 3-byte character
    parser = SSEParser()
    assert parser.feed(raw[:cut]) == []
    assert json.loads(parser.feed(raw[cut:])[0])["choices"][0]["text"] == "é中"


def _record() -> RequestRecord:
    return RequestRecord(index=0, scheduled_s=0.0, prompt_tokens_requested=5, output_tokens_requested=4)


def test_events_fill_the_record():
    rec = _record()
    last = None
    events = [(1.0, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),  # no text
              (1.5, {"choices": [{"index": 0, "delta": {"content": "ab"}}]}),
              (1.75, {"choices": [{"index": 0, "text": "cd"}]}),
              (2.5, {"choices": [{"index": 0, "text": "e", "finish_reason": "length"}]}),
              (2.5, {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}})]
    for now, obj in events:
        last = _handle_event(json.dumps(obj), rec, now, start=1.0, last_text_at=last)
    last = _handle_event("[DONE]", rec, 3.0, 1.0, last)
    assert rec.ttft_s == 0.5  # the first chunk carrying text, not the role chunk
    assert rec.itl_s == [0.25, 0.75]
    assert rec.num_chunks == 3 and rec.num_output_chars == 5
    assert (rec.prompt_tokens, rec.output_tokens, rec.is_usage_reported) == (5, 4, True)
    assert rec.finish_reason == "length" and rec.error is None
    rec.e2e_s = 2.0
    assert rec.tpot_s == (2.0 - 0.5) / 3


def test_in_stream_error_is_recorded():
    rec = _record()
    _handle_event('{"error": {"message": "out of KV blocks", "code": 503}}', rec, 1.0, 0.0, None)
    assert rec.error is not None and "out of KV blocks" in rec.error and not rec.success
