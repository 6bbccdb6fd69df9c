"""Streaming text tests: the incremental detokenizer against a full decode, and stop strings against a
simple whole-text reference under every way of splitting the text into deltas."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from onecall.errors import InvalidParameterError
from onecall.text.detokenizer import IncrementalDetokenizer
from onecall.text.stop import StopStringMatcher
from onecall.text.tokenizer import Tokenizer

# pieces of text whose characters often span several byte-level tokens
POOL = [
    "hello",
    " world",
    "\n",
    "  ",
    "12",
    ".",
    "é",
    "ñ",
    "日本",
    "語",
    "中文",
    "😀",
    "👍🏽",
    "🇫🇷",
    "👨\u200d👩\u200d👧",
    "ä¸",
]
SPECIAL_TEXT = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


# `tok`: the embedded SmolLM2-135M-Instruct's tokenizer, built once per session (tests/conftest.py)


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    """Every delta, the flush included (as the last element)."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert detok.text == "".join(deltas)
    return deltas


def random_text_ids(tok: Tokenizer, rng: random.Random, with_specials: bool) -> list[int]:
    pool = POOL + SPECIAL_TEXT if with_specials else POOL
    return tok.encode("".join(rng.choice(pool) for _ in range(rng.randint(1, 25))))


def test_valid_text_streams_whole_characters(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(300):
        ids = random_text_ids(tok, rng, with_specials=True)
        for skip in (True, False):
            full = tok.decode(ids, skip_special_tokens=skip)
            assert "\ufffd" not in full
            deltas = stream(tok, ids, skip)
            assert "".join(deltas) == full
            assert not any("\ufffd" in d for d in deltas)
            assert deltas[-1] == ""  # valid text: nothing is left for the flush


def test_random_ids_concatenate_to_full_decode(tok: Tokenizer) -> None:
    """Uniformly random ids include lone pieces of characters: U+FFFD may appear, but only where the full
    decode has it, and the deltas still add up to exactly the full decode."""
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        ids += [rng.choice(range(17)) for _ in range(rng.randint(0, 3))]
        rng.shuffle(ids)
        for skip in (True, False):
            full = tok.decode(ids, skip_special_tokens=skip)
            assert "".join(stream(tok, ids, skip)) == full


def test_split_character_is_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("a😀")
    assert len(ids) >= 3, "the emoji should take several byte-level tokens"
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[0]) == "a"
    assert [detok.add(i) for i in ids[1:-1]] == [""] * (len(ids) - 2)
    assert detok.add(ids[-1]) == "😀"
    # stream ends mid-character: only flush may produce the replacement character
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids[:-1]] == ["a"] + [""] * (len(ids) - 2)
    assert detok.flush() == tok.decode(ids[:-1])[1:] and detok.flush() == ""


def test_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi 😀<|im_end|>")
    assert "".join(stream(tok, ids, skip_special_tokens=True)) == "assistant\nHi 😀"
    assert "".join(stream(tok, ids, skip_special_tokens=False)) == "<|im_start|>assistant\nHi 😀<|im_end|>"


def test_decode_window_stays_small(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """O(1)-ish: each step decodes a few recent ids, not the whole output."""
    rng = random.Random(2)
    ids = tok.encode("".join(rng.choice(POOL) for _ in range(200)))
    widths: list[int] = []
    decode = tok.decode

    def spy(window: list[int], skip_special_tokens: bool = True) -> str:
        widths.append(len(window))
        return decode(window, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", spy)
    assert "".join(stream(tok, ids)) == decode(ids)
    assert len(ids) > 300 and max(widths) <= 8  # 6 seen: a held 4-byte emoji plus context


def sentencepiece_tokenizer(folder: Path) -> Tokenizer:
    """A Llama-2-style tokenizer.json: "▁" for spaces, <0xNN> byte fallback, the first space stripped."""
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o"), ("▁", "w"), ("▁w", "o")]
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *"▁abdehlnortw"]
    pieces += ["".join(m) for m in merges]
    hf = HFTokenizer(
        models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True)
    )
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])  # type: ignore[assignment]
    hf.decoder = decoders.Sequence(  # type: ignore[assignment]
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer.from_hf_folder(folder)


def test_sentencepiece_spaces_and_byte_fallback(tmp_path: Path) -> None:
    """Decoding a token alone would lose its leading space; the window keeps it."""
    tok = sentencepiece_tokenizer(tmp_path)
    text = "hello world 😀 and 日本 there"
    ids = tok.encode(text)
    assert "<0xF0>" in [tok.id_to_token(i) for i in ids]  # the emoji falls back to bytes
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert deltas[:2] == ["hello", " wo"] and not any("\ufffd" in d for d in deltas)
    assert (
        b"".join(tok.token_bytes(i) for i in ids) == b" " + text.encode()
    )  # with sentencepiece's prefix space


# ---- stop strings ----


def run_stops(stops: list[str], deltas: list[str]) -> tuple[str, str | None]:
    """What a stream emits: deltas until a match, or everything plus the flush."""
    matcher = StopStringMatcher(stops)
    out = []
    for delta in deltas:
        text, matched = matcher.feed(delta)
        out.append(text)
        if matched is not None:
            assert matcher.feed("more") == ("", None)  # everything after the stop is dropped
            return "".join(out), matched
        assert len(matcher._held) < max(map(len, stops))  # held text never reaches a whole stop
    return "".join(out) + matcher.flush(), None


def reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The stop string that completes first while reading the text char by char (longest on ties)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return text[: end - len(stop)], stop
    return text, None


def all_splits(text: str) -> list[list[str]]:
    """Every way to cut `text` into consecutive non-empty deltas."""
    splits = []
    for cuts in itertools.product([False, True], repeat=len(text) - 1):
        pieces, start = [], 0
        for i, cut in enumerate(cuts, start=1):
            if cut:
                pieces.append(text[start:i])
                start = i
        splits.append([*pieces, text[start:]])
    return splits


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("12abc34", ["abc"], ("12", "abc")),  # split inside the stop every possible way
        ("aab", ["ab"], ("a", "ab")),  # the first "a" looked like a stop prefix, then did not
        ("abcx", ["ab"], ("", "ab")),  # stop at the very start
        ("we end stop", ["stop", "end"], ("we ", "end")),  # several stops: the first one wins
        ("abcd", ["abcd", "bc"], ("a", "bc")),  # the one that completes first, however the text arrives
        ("xxabab", ["abab", "bab"], ("xx", "abab")),  # both complete together: the longer
        ("hello wor", ["world!"], ("hello wor", None)),  # no stop: flush returns the held "wor"
    ],
)
def test_stop_strings_every_split(text: str, stops: list[str], expected: tuple[str, str | None]) -> None:
    assert reference_stop(text, stops) == expected
    for deltas in all_splits(text):
        assert run_stops(stops, deltas) == expected, deltas


def test_stop_strings_random_against_reference() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 14)))
        stops = [
            "".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, max(len(text) - 1, 0)))) if text else []
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)] if text else [""]
        assert run_stops(stops, deltas) == reference_stop(text, stops), (text, stops, deltas)


def test_stop_flush_and_validation() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("42</ans") == ("42", None)
    assert matcher.flush() == "</ans" and matcher.flush() == ""
    assert StopStringMatcher([]).feed("anything") == ("anything", None)
    with pytest.raises(InvalidParameterError):
        StopStringMatcher(["ok", ""])
    with pytest.raises(InvalidParameterError):
        StopStringMatcher("abc")
