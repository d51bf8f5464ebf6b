"""IncrementalDetokenizer against full decodes of the shipped byte-level BPE tokenizer, on its three paths: the
byte table (what that tokenizer gets), tokenizers' DecodeStream (what other fast tokenizers get) and the decode
window (tokenizers without a Rust backend)."""
from __future__ import annotations

import random

import pytest

from vllm.assets import TINY_TOKENIZER_DIR
import vllm.engine.detokenizer as detokenizer_module
from vllm.engine.detokenizer import IncrementalDetokenizer
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.transformers_utils.tokenizer import byte_level_pieces, decoder_for, get_tokenizer

MULTIBYTE = "café ☕ 日本語 — naïve 😀 done"
SPECIAL_IDS = [0, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer(TINY_TOKENIZER_DIR)


@pytest.fixture(autouse=True, params=["byte_table", "decode_stream", "window"])
def path(request, monkeypatch):
    if request.param != "byte_table":
        monkeypatch.setattr(detokenizer_module, "byte_level_pieces", lambda tokenizer, skip: None)
    if request.param == "window":
        monkeypatch.setattr(detokenizer_module, "DecodeStream", None)
    return request.param


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def chunks(ids: list[int], rng: random.Random | None):
    i = 0
    while i < len(ids):
        n = 1 if rng is None else rng.randint(1, 7)
        yield ids[i:i + n]
        i += n


def check_against_full_decode(tok, prompt, ids, params, rng=None):
    det = IncrementalDetokenizer(tok, prompt, params)
    seen: list[int] = []
    for chunk in chunks(ids, rng):
        assert det.update(chunk) is None
        seen += chunk
        full = tok.decode(seen, skip_special_tokens=params.skip_special_tokens)
        # Only a trailing incomplete UTF-8 sequence may be missing, and nothing else.
        assert det.output_text == full.rstrip("\ufffd"), (seen, full)
    return det


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunked", [False, True])
def test_random_ids_match_full_decode(tok, skip, chunked):
    rng = random.Random(1234 + skip + 2 * chunked)
    vocab = len(tok) + 40  # ids past the tokenizer's vocabulary decode to nothing (a model's vocab can be larger)
    for _ in range(40):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        check_against_full_decode(tok, prompt, ids, SamplingParams(skip_special_tokens=skip),
                                  rng if chunked else None)


@pytest.mark.parametrize("chunked", [False, True])
def test_multibyte_text_split_across_tokens(tok, chunked):
    ids = enc(tok, MULTIBYTE)
    assert any(tok.decode([i]) == "\ufffd" for i in ids), "test needs tokens that split UTF-8 characters"
    rng = random.Random(7)
    for _ in range(10):
        prompt = enc(tok, "User: say it")
        det = check_against_full_decode(tok, prompt, ids, SamplingParams(), rng if chunked else None)
        assert det.output_text == MULTIBYTE
        assert "\ufffd" not in det.output_text


def test_held_back_bytes_then_completed(tok):
    ids = enc(tok, "☕")
    assert len(ids) == 3
    det = IncrementalDetokenizer(tok, [], SamplingParams())
    det.update(ids[:1])
    det.update(ids[1:2])
    assert det.output_text == ""
    det.update(ids[2:])
    assert det.output_text == "☕"


def test_prompt_ending_mid_character_is_not_used(tok):
    # The generated ids alone decode to a replacement char; the prompt's bytes must not complete it.
    coffee = enc(tok, "☕")
    det = IncrementalDetokenizer(tok, enc(tok, "x") + coffee[:1], SamplingParams())
    det.update(coffee[1:] + enc(tok, "a"))
    assert det.output_text == tok.decode(coffee[1:] + enc(tok, "a")) == "\ufffd\ufffda"


def test_decode_window_stays_small(tok):
    calls: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = enc(tok, MULTIBYTE * 40)
    det = IncrementalDetokenizer(Counting(), enc(tok, "prompt text"), SamplingParams())
    for i in ids:
        det.update([i])
    assert det.output_text == MULTIBYTE * 40
    assert len(ids) > 500 and max(calls) <= 12, max(calls)


@pytest.mark.parametrize("skip", [True, False])
def test_final_only_without_stop_strings_decodes_once_when_read(tok, skip):
    """FINAL_ONLY requests with no stop string collect ids and decode once, to the incremental text exactly."""
    rng = random.Random(99 + skip)
    calls: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    for ids in [enc(tok, MULTIBYTE), *([rng.randrange(len(tok)) for _ in range(rng.randint(1, 80))]
                                       for _ in range(30))]:
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 8))]
        final = SamplingParams(skip_special_tokens=skip, output_kind=RequestOutputKind.FINAL_ONLY)
        lazy = IncrementalDetokenizer(Counting(), prompt, final)
        eager = IncrementalDetokenizer(tok, prompt, SamplingParams(skip_special_tokens=skip))
        calls.clear()
        for chunk in chunks(ids, rng):
            assert lazy.update(chunk) is None
            eager.update(chunk)
        assert calls == [], "no decode while the ids arrive"
        assert lazy.output_text == eager.output_text == lazy.get_next_output_text(True, False)
        assert calls == [len(ids)], "one decode of the generated ids, on the first read only"
    stopping = IncrementalDetokenizer(tok, [], SamplingParams(stop=["of"], output_kind=RequestOutputKind.FINAL_ONLY))
    assert stopping.update(enc(tok, "the capital of France")) == "of", "stop strings still match token by token"


def capital_ids(tok):
    ids = enc(tok, "the") + [367] + enc(tok, " of France")
    assert tok.decode([367]) == " capital"
    return ids


@pytest.mark.parametrize("include", [False, True])
def test_stop_in_middle_of_token(tok, include):
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["pit"], include_stop_str_in_output=include))
    ids = capital_ids(tok)
    results = [det.update([i]) for i in ids]
    assert results[:ids.index(367)] == [None] * ids.index(367)
    assert results[ids.index(367)] == "pit"
    assert det.output_text == ("the capit" if include else "the ca")
    assert det.update(enc(tok, " more")) is None
    assert det.output_text == ("the capit" if include else "the ca")
    assert det.get_next_output_text(finished=True, delta=False) == det.output_text


@pytest.mark.parametrize("include", [False, True])
def test_stop_spanning_two_tokens(tok, include):
    ids = enc(tok, "hello world")
    assert [tok.decode([i]) for i in ids[:3]] == ["he", "ll", "o"]
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["ell"], include_stop_str_in_output=include))
    assert det.update(ids[:1]) is None
    assert det.update(ids[1:2]) == "ell"
    assert det.output_text == ("hell" if include else "h")


def test_earliest_stop_wins(tok):
    ids = enc(tok, "hello world")
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["world", "o w", "llo"]))
    assert det.update(ids) == "llo"  # all three match in one chunk; "llo" starts first
    assert det.output_text == "he"
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["world", "lo w"], include_stop_str_in_output=True))
    assert det.update(ids) == "lo w"
    assert det.output_text == "hello w"


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_streamed_deltas(tok, include, chunked):
    text = "The capital of France is Paris. END of text here"
    stops = ["END", "Paris."]
    ids = enc(tok, text)
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=stops, include_stop_str_in_output=include))
    rng = random.Random(3) if chunked else None
    deltas, streamed = [], ""
    for chunk in chunks(ids, rng):
        stopped = det.update(chunk)
        done = stopped is not None
        deltas.append(det.get_next_output_text(finished=done, delta=True))
        streamed += deltas[-1]
        assert det.get_next_output_text(finished=done, delta=False) == streamed
        if not include:
            assert all(s not in streamed for s in stops), streamed
        if done:
            break
    assert stopped == "Paris."
    assert "".join(deltas) == det.output_text
    assert det.output_text == "The capital of France is " + ("Paris." if include else "")
    assert det.get_next_output_text(finished=True, delta=True) == ""


def test_streaming_holds_back_possible_stop_start(tok):
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["xyz"]))
    det.update(enc(tok, "abcxy"))
    assert det.get_next_output_text(finished=False, delta=True) == "abc"
    assert det.get_next_output_text(finished=True, delta=True) == "xy"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    ids = enc(tok, "hi") + [4, 2] + enc(tok, "caf") + [3] + enc(tok, "é ok") + [0, 1]
    det = check_against_full_decode(tok, [1, 3], ids, SamplingParams(skip_special_tokens=skip))
    if skip:
        assert det.output_text == "hicafé ok"
    else:
        assert det.output_text == "hi<|im_end|><eos>caf<|im_start|>é ok<pad><bos>"


def test_special_token_between_split_bytes(tok):
    # Skipping a special id that sits between the two bytes of "é" still joins them, as a full decode does.
    e = enc(tok, "é")
    assert len(e) == 2
    for skip in (True, False):
        ids = e[:1] + [2] + e[1:] + enc(tok, "!")
        check_against_full_decode(tok, [], ids, SamplingParams(skip_special_tokens=skip))


def test_stop_string_not_matched_in_prompt(tok):
    det = IncrementalDetokenizer(tok, enc(tok, "say STOP"), SamplingParams(stop=["STOP"]))
    assert det.update(enc(tok, " now")) is None
    assert det.output_text == " now"


def test_detokenize_false(tok):
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(detokenize=False, stop=["a"])
    det = IncrementalDetokenizer(tok, enc(tok, "hi"), SamplingParams(detokenize=False))
    assert det.update(enc(tok, "a banana")) is None
    assert det.output_text == ""
    assert det.get_next_output_text(finished=False, delta=True) == ""
    assert det.get_next_output_text(finished=True, delta=False) == ""


@pytest.mark.parametrize("skip", [True, False])
def test_fast_decoder_gives_the_tokenizers_text(tok, skip):
    """decoder_for's Rust-backend shortcut must equal tokenizer.decode on any ids: special tokens, multi-byte
    characters cut mid-sequence, random ids."""
    rng = random.Random(7)
    decode = decoder_for(tok)
    cases = [enc(tok, MULTIBYTE), enc(tok, MULTIBYTE)[:7], SPECIAL_IDS + enc(tok, "a b") + SPECIAL_IDS[::-1], []]
    cases += [[rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))] for _ in range(200)]
    for ids in cases:
        assert decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip), ids


def test_fast_decoder_keeps_the_slow_path_when_spaces_are_cleaned_up(tok):
    class CleansUp:
        clean_up_tokenization_spaces = True
        backend_tokenizer = tok.backend_tokenizer

        def decode(self, ids, skip_special_tokens):
            return "cleaned"
    assert decoder_for(CleansUp())([5, 6], True) == "cleaned"


@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_pieces_are_each_ids_decoded_bytes(tok, skip):
    pieces = byte_level_pieces(tok, skip)
    assert pieces is not None and len(pieces) == len(tok)
    assert byte_level_pieces(tok, skip) is pieces, "built once per tokenizer"
    assert pieces[0] == (b"" if skip else b"<pad>")
    e_acute = enc(tok, "é")
    assert b"".join(pieces[i] for i in e_acute) == "é".encode()


def test_byte_level_pieces_only_for_byte_level_decoders(tok):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=wordpiece, clean_up_tokenization_spaces=False)
    assert byte_level_pieces(fast, True) is None

    class CleansUp:
        clean_up_tokenization_spaces = True
        backend_tokenizer = tok.backend_tokenizer
    assert byte_level_pieces(CleansUp(), True) is None


def test_text_stays_right_over_long_runs_of_silent_ids(tok):
    """The case that made the window grow: thousands of ids that decode to nothing, then text."""
    det = IncrementalDetokenizer(tok, [], SamplingParams())
    for _ in range(3000):
        assert det.update([len(tok) + 7]) is None
        det.update([0])  # <pad>, skipped
    det.update(enc(tok, "ok é"))
    assert det.output_text == "ok é"


def test_metaspace_tokenizer_streams_as_the_window_decodes(path):
    """A SentencePiece-style tokenizer (Metaspace: the text of a token depends on its neighbour), on the
    DecodeStream and window paths: the same text, token by token, after the same prompt context."""
    if path == "byte_table":
        pytest.skip("a Metaspace tokenizer has no byte table")
    from tokenizers import SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator([MULTIBYTE + " the quick brown fox jumps over the lazy dog"] * 20, vocab_size=120,
                           min_frequency=1)
    mtok = PreTrainedTokenizerFast(tokenizer_object=sp._tokenizer)
    ids = enc(mtok, "the lazy " + MULTIBYTE + " fox")
    det = IncrementalDetokenizer(mtok, ids[:4], SamplingParams())
    assert (det._stream is not None) == (path == "decode_stream")
    for t in ids[4:]:
        det.update([t])
    full, context = mtok.decode(ids), mtok.decode(ids[:4])
    assert det.output_text == full[len(context):]
