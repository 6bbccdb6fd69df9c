"""SentencePiece ("llama") GGUF tokenizers: tiny GGUFs written here, read by onecall and by two oracles.

The oracles:
- transformers' own GGUF tokenizer loading, AutoTokenizer.from_pretrained(folder, gguf_file=...), on the
  same file: its vocabulary, merges recovered from the scores, byte fallback and decoder;
- `llama_cpp_tokenize` below, llama.cpp's SPM algorithm (llama-vocab.cpp: tokenizer_st_partition, the
  space prefix per run, llm_tokenizer_spm's merge-by-score) written out in plain Python.

Where they differ we follow llama.cpp (onecall/text/sentencepiece.py says why): transformers adds no "▁"
to a run that already starts with a space, nor to text after a matched control/user-defined token.
On text without either, all three agree; on the rest, transformers' model with the normalizer Llama-2's
own tokenizer.json uses ("legacy": prepend "▁" to every run) agrees with llama.cpp and with us.
Scores tied between different pieces: we rank merges as transformers does and equal it; llama.cpp joins
the leftmost pair and can differ (test_tied_scores_follow_transformers). A file's add_space_prefix=false:
transformers ignores it, we and llama.cpp do not (test_flags_bos_and_space_prefix).

Decoding follows transformers for valid text: with skip_special_tokens, llama.cpp keeps the leading space
of text after a leading BOS ("<s>▁hi" -> " hi"); transformers and we give "hi". For invalid bytes we
follow llama.cpp's bytes (one U+FFFD per invalid sequence, not one per byte piece of the run).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFValueType, GGUFWriter
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import normalizers

from onecall.errors import UnsupportedModelError
from onecall.formats.gguf import GGUFFile
from onecall.text.chat_template import render_chat
from onecall.text.detokenizer import IncrementalDetokenizer
from onecall.text.sentencepiece import SPACE
from onecall.text.tokenizer import Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
    "{% else %} {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
)
WORDS = "hello world the quick brown fox jumps over lazy dog tokenizer says hi there INST"
TEXTS = [
    "hello world", "Hello World", "the quick brown fox jumps over the lazy dog", "hi",
    " hello", "  hello", "   ", " ", "hello  world", "hello world  ", "a  b   c    d",
    "\n", "\n\nthe", "line one\nline two\r\n\tthe end", "hello\n world",
    "12345", "3.14 and 1,000,000", "x1y22z333",
    "日本語のテキスト", "café naïve", "emoji 😀👍🏽 flag 🇫🇷", "mixed 日本 text 🎉!",
    "[INST] hi there [/INST]", "<s>hello</s>", "a<unk>b", "x<think>y", "[INST][/INST]", "</s> trailing",
    "[ INST] not a control", "",
]  # fmt: skip


# ---- writing tiny GGUFs ----


def spm_vocab(seed: int = 0) -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, the 256 byte pieces, every substring of some "▁"-words with distinct random
    scores (many overlapping pieces, so the merge order matters), then control and user-defined tokens."""
    rng = random.Random(seed)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [UNKNOWN, CONTROL, CONTROL, *[BYTE] * 256]
    words = [SPACE + w for w in WORDS.split()] + [
        "123",
        "45",
        "3.",
        SPACE * 2,
        SPACE * 4,
        "\n\n",
        "日本",
        "é",
    ]
    pieces = sorted({w[i:j] for w in words for i in range(len(w)) for j in range(i + 1, len(w) + 1)})
    rng.shuffle(pieces)
    tokens += pieces
    types += [NORMAL] * len(pieces)
    tokens += ["[INST]", "[/INST]", "<think>"]
    types += [CONTROL, CONTROL, USER_DEFINED]
    # SentencePiece scores: 0 for non-normal pieces, distinct negatives (log-probs) for normal ones
    scores = [-float(i) - rng.random() / 2 if t == NORMAL else 0.0 for i, t in enumerate(types)]
    return tokens, scores, types


def write_spm_gguf(path: Path, vocab: tuple[list[str], list[float], list[int]], **flags: Any) -> Path:
    """A GGUF with a SentencePiece vocabulary, the llama.* keys transformers needs to make a config
    from it, and one dummy tensor. `flags`: tokenizer.ggml.<name> booleans or strings."""
    tokens, scores, types = vocab
    writer = GGUFWriter(str(path), "llama")
    for key, value in {
        "context_length": 64, "embedding_length": 8, "block_count": 1, "feed_forward_length": 16,
        "attention.head_count": 1, "attention.head_count_kv": 1,
    }.items():  # fmt: skip
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_key_value("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY)
    writer.add_key_value("tokenizer.ggml.scores", scores, GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
    writer.add_key_value(
        "tokenizer.ggml.token_type", types, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32
    )
    for key, token in (("unknown", "<unk>"), ("bos", "<s>"), ("eos", "</s>")):
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", tokens.index(token))
    for key, value in flags.items():
        if isinstance(value, bool):
            writer.add_bool(f"tokenizer.ggml.{key}", value)
        else:
            writer.add_string(f"tokenizer.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- llama.cpp's algorithm, in plain Python ----


def llama_cpp_tokenize(
    text: str, vocab: tuple[list[str], list[float], list[int]], add_space_prefix: bool = True
) -> list[int]:
    """llama.cpp's SPM tokenize (parse_special, no BOS): cut out control/user-defined/unknown tokens,
    longest first; each remaining run gets a " " prefix when first or after a token, " " -> "▁", then
    join the best-scoring adjacent pair (leftmost on ties) until none is a piece; bytes for the rest."""
    tokens, scores, types = vocab
    ids = {t: i for i, t in reversed(list(enumerate(tokens)))}  # first id wins
    specials = sorted(
        (t for t, k in zip(tokens, types) if k in (UNKNOWN, CONTROL, USER_DEFINED)), key=len, reverse=True
    )
    fragments: list[str | int] = [text] if text else []
    for special in specials:
        cut: list[str | int] = []
        for fragment in fragments:
            if isinstance(fragment, int):
                cut.append(fragment)
                continue
            for k, part in enumerate(fragment.split(special)):
                cut += ([ids[special]] if k else []) + ([part] if part else [])
        fragments = cut
    out: list[int] = []
    after_token = True
    for fragment in fragments:
        if isinstance(fragment, int):
            out.append(fragment)
            after_token = True
            continue
        symbols = list(((" " if add_space_prefix and after_token else "") + fragment).replace(" ", SPACE))
        while True:
            joinable = [
                (scores[ids[a + b]], -k) for k, (a, b) in enumerate(zip(symbols, symbols[1:])) if a + b in ids
            ]
            if not joinable:
                break
            k = -max(joinable)[1]
            symbols[k : k + 2] = [symbols[k] + symbols[k + 1]]
        for symbol in symbols:
            out += [ids[symbol]] if symbol in ids else [ids[f"<0x{b:02X}>"] for b in symbol.encode()]
        after_token = False
    return out


# ---- fixtures ----


@pytest.fixture(scope="module")
def vocab() -> tuple[list[str], list[float], list[int]]:
    return spm_vocab()


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory, vocab: Any) -> Path:
    folder = tmp_path_factory.mktemp("spm")
    return write_spm_gguf(folder / "spm.gguf", vocab, chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def ours(gguf_file: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(gguf_file).metadata)


@pytest.fixture(scope="module")
def ref(gguf_file: Path) -> Any:
    """transformers' tokenizer for the same file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def ref_legacy(ref: Any) -> HFTokenizer:
    """transformers' model and decoder with the legacy normalizer of Llama-2's own tokenizer.json
    (prepend "▁" to every run, " " -> "▁"; no pre-tokenizer): llama.cpp's space-prefix rule."""
    backend = HFTokenizer.from_str(ref.backend_tokenizer.to_str())
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])  # type: ignore[assignment]
    backend.pre_tokenizer = None  # type: ignore[assignment]
    return backend


def has_token(text: str) -> bool:
    """Whether the text holds a control, unknown or user-defined token (matched whole)."""
    return any(t in text for t in ("<s>", "</s>", "<unk>", "[INST]", "[/INST]", "<think>"))


def conventions_agree(text: str) -> bool:
    """transformers and llama.cpp prefix "▁" alike: the text starts with no space and holds no token."""
    return not text.startswith(" ") and not has_token(text)


# ---- encode ----


def test_encode_matches_transformers_where_conventions_agree(ours: Tokenizer, ref: Any) -> None:
    checked = [t for t in TEXTS if conventions_agree(t)]
    assert len(checked) > 15
    for text in checked:
        assert ours.encode(text, add_special_tokens=True) == ref.encode(text), text
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text


def test_encode_matches_llama_cpp_and_legacy_transformers(
    ours: Tokenizer, ref_legacy: HFTokenizer, vocab: Any
) -> None:
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == llama_cpp_tokenize(text, vocab), text
        assert ids == ref_legacy.encode(text, add_special_tokens=False).ids, text


def test_where_transformers_differs(ours: Tokenizer, ref: Any) -> None:
    """The two documented differences, spelled out as pieces."""

    def pieces(ids: list[int]) -> list[str]:
        return [ours.id_to_token(i) for i in ids]

    def ref_pieces(text: str) -> list[str]:
        return list(ref.convert_ids_to_tokens(ref.encode(text, add_special_tokens=False)))

    # a leading space: llama.cpp (and sentencepiece) add "▁" anyway, transformers does not
    assert "".join(pieces(ours.encode(" hello"))) == SPACE * 2 + "hello"
    assert "".join(ref_pieces(" hello")) == SPACE + "hello"
    # after a control token: llama.cpp prefixes the next run, as the reference code of Llama-2 (after BOS)
    # and Mistral (mistral_common, after [INST]) does by encoding each run with the sentencepiece library
    ours_ids = ours.encode("[INST]hi")
    assert pieces(ours_ids)[0] == "[INST]" and "".join(pieces(ours_ids[1:])) == SPACE + "hi"
    assert ref_pieces("[INST]hi") == ["[INST]", "hi"]


def test_random_text_matches_llama_cpp(ours: Tokenizer, vocab: Any) -> None:
    """Random strings over the vocabulary's alphabet, spaces, tokens and byte-fallback characters."""
    extra = [" ", " ", "  ", "\n", "日", "本", "😀", "é", "1", "5", ".", "[INST]", "</s>", "<think>"]
    alphabet = [*sorted(set(WORDS.replace(" ", ""))), *extra]
    rng = random.Random(1)
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        assert ours.encode(text) == llama_cpp_tokenize(text, vocab), text


def test_tied_scores_follow_transformers(tmp_path: Path, vocab: Any) -> None:
    """Pieces with equal scores: we rank their merges as transformers does (longer left half first), so
    we equal transformers; llama.cpp joins the leftmost pair and can differ (e.g. "  w": "▁▁" + "w" there,
    "▁" + "▁w" here when "▁▁" and "▁w" tie)."""
    from transformers import AutoTokenizer

    tokens, _, types = vocab
    tied = [float(-len(t) % 3) if k == NORMAL else 0.0 for t, k in zip(tokens, types, strict=True)]
    write_spm_gguf(tmp_path / "tied.gguf", (tokens, tied, types))
    tok = Tokenizer.from_gguf_metadata(GGUFFile(tmp_path / "tied.gguf").metadata)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tied.gguf")
    alphabet = [*sorted(set(WORDS.replace(" ", ""))), " ", " ", "  ", "\n"]
    rng = random.Random(2)
    num_llama_cpp_differs = 0
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))).lstrip(" ")
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        num_llama_cpp_differs += ids != llama_cpp_tokenize(text, (tokens, tied, types))
    assert num_llama_cpp_differs > 0  # the difference is real, and this test would see it


def test_flags_bos_and_space_prefix(tmp_path: Path, vocab: Any) -> None:
    """No flags: BOS and the space prefix (llama.cpp's SentencePiece defaults). add_bos_token=false and
    add_space_prefix=false are obeyed (transformers ignores the second and prefixes anyway)."""
    default = Tokenizer.from_gguf_metadata(GGUFFile(write_spm_gguf(tmp_path / "a.gguf", vocab)).metadata)
    hi = default.encode("hi")
    assert default.add_bos_token and default.encode("hi", add_special_tokens=True) == [1, *hi]
    flagged = write_spm_gguf(tmp_path / "b.gguf", vocab, add_bos_token=False, add_space_prefix=False)
    tok = Tokenizer.from_gguf_metadata(GGUFFile(flagged).metadata)
    assert tok.add_bos_token is False and tok.encode("hi", add_special_tokens=True) == tok.encode("hi")
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == llama_cpp_tokenize(text, vocab, add_space_prefix=False), text
        if not has_token(text):
            assert tok.decode(ids) == text  # no prefix added, none stripped
    assert tok.id_to_token(tok.encode("hello")[0]) != SPACE + "hello"


# ---- decode, bytes, streaming ----


def piece_bytes_of(piece: str) -> bytes:
    """llama.cpp's token_to_piece for a normal or byte piece: "▁" -> " ", `<0xNN>` -> the byte."""
    is_byte = len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
    return bytes([int(piece[3:5], 16)]) if is_byte else piece.replace(SPACE, " ").encode()


def test_decode_matches_transformers(ours: Tokenizer, ref: Any) -> None:
    """Equal to transformers' decode wherever the pieces' bytes are valid UTF-8; where they are not, the
    bytes as llama.cpp joins them, read with U+FFFD for each invalid sequence (transformers writes one
    U+FFFD per byte piece of the whole run)."""
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=True)
        for skip in (True, False):
            expected = ref.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == expected, text
        if conventions_agree(text):
            assert ours.decode(ids) == text  # the prefix space added on encode is removed on decode
    rng = random.Random(0)
    num_invalid = 0
    for _ in range(300):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            kept = [i for i in ids if not (skip and i in ours.special_ids)]
            raw = b"".join(piece_bytes_of(ours.id_to_token(i)) for i in kept)
            try:
                raw.decode()
                expected = ref.decode(ids, skip_special_tokens=skip)
            except UnicodeDecodeError:
                num_invalid += 1
                expected = raw.decode(errors="replace").removeprefix(" ")
            assert ours.decode(ids, skip_special_tokens=skip) == expected, ids
    assert 100 < num_invalid < 500  # both branches taken


def test_control_tokens_and_ids(ours: Tokenizer, ref: Any, vocab: Any) -> None:
    tokens, _, _ = vocab
    inst, end_inst, think = (tokens.index(t) for t in ("[INST]", "[/INST]", "<think>"))
    assert ours.vocab_size == len(tokens) == len(ref)
    assert (ours.bos_token_id, ours.bos_token, ours.eos_token, ours.eos_token_ids) == (1, "<s>", "</s>", {2})
    assert ours.special_ids == {0, 1, 2, inst, end_inst}  # <think> is user-defined: text, not control
    assert ours.special_ids == {i for i, t in ref.added_tokens_decoder.items() if t.special}
    assert ours.encode("<s>[INST]<think></s>") == [1, inst, think, 2]
    assert ours.decode([1, inst, think, 2]) == "<think>"


def test_token_bytes(ours: Tokenizer, vocab: Any) -> None:
    tokens, _, types = vocab
    for i, (piece, kind) in enumerate(zip(tokens, types)):
        expected = bytes([int(piece[3:5], 16)]) if kind == BYTE else piece.replace(SPACE, " ").encode()
        assert ours.token_bytes(i) == expected, piece
    for text in TEXTS:
        if conventions_agree(text) and text:
            ids = ours.encode(text)
            assert b"".join(ours.token_bytes(i) for i in ids) == b" " + text.encode()  # with the prefix space


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_incremental_detokenizer(ours: Tokenizer) -> None:
    """Byte-fallback pieces are held until they form a character; deltas add up to the full decode."""
    emoji = ours.encode("😀")
    assert [ours.id_to_token(i) for i in emoji] == [SPACE, "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert stream(ours, emoji) == ["", "", "", "", "😀", ""]
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=True)
        deltas = stream(ours, ids)
        assert "".join(deltas) == ours.decode(ids), text
        assert not any("\ufffd" in d for d in deltas), text
    # spaces between words are kept, the first word's prefix space is dropped as decode() does, and
    # the three byte pieces of 語 come out as one character
    ids = ours.encode("hello world 日本語")
    assert [ours.id_to_token(i) for i in ids][-3:] == ["<0xE8>", "<0xAA>", "<0x9E>"]
    assert stream(ours, ids) == ["hello", " world", " ", "日本", "", "", "語", ""]
    # any ids, invalid byte runs and control tokens included: the deltas add up to decode()
    rng = random.Random(3)
    for _ in range(300):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 20))]
        assert "".join(stream(ours, ids)) == ours.decode(ids), ids


def test_the_prompt_as_context_keeps_the_first_tokens_space(ours: Tokenizer) -> None:
    """An output continuing a prompt: with the prompt's last ids as context, "▁world" after "hello"
    streams as " world" (decoding it alone drops the space), and the deltas are exactly the text the
    output adds after the prompt; context ending in half a character is not used."""
    prompt, out = ours.encode("hello"), ours.encode("hello world 日本語")[len(ours.encode("hello")) :]
    detok = IncrementalDetokenizer(ours, context=prompt)
    deltas = [detok.add(i) for i in out] + [detok.flush()]
    assert deltas[0] == " world"
    assert "".join(deltas) == ours.decode(prompt + out)[len(ours.decode(prompt)) :]
    from onecall.server.serving_common import token_text  # a logprob's token, as the server writes it

    assert token_text(ours, out[0]) == " world" and ours.decode([out[0]]) == "world"
    half = ours.encode("😀")[:-1]  # the last byte piece of the emoji missing
    detok = IncrementalDetokenizer(ours, context=half)
    assert detok.add(out[0]) == ours.decode([out[0]])  # as without context


# ---- text that continues other text (what a grammar engine forces mid-output) ----


def test_encode_continuation(ours: Tokenizer, vocab: Any) -> None:
    """No space prefix at the start; otherwise llama.cpp's tokenization of the same text."""
    assert [ours.id_to_token(i) for i in ours.encode_continuation("{")] == ["<0x7B>"]
    assert [ours.id_to_token(i) for i in ours.encode_continuation("hello world")][-1] == SPACE + "world"
    assert ours.id_to_token(ours.encode_continuation(" hello")[0]) == SPACE + "hello"
    for text in TEXTS:
        assert ours.encode_continuation(text) == llama_cpp_tokenize(text, vocab, add_space_prefix=False), text
    assert ours.encode_continuation("a</s>b") == [
        *ours.encode_continuation("a"),
        2,
        *ours.encode_continuation("b"),
    ]


def test_llguidance_forces_text_without_a_space_prefix(ours: Tokenizer) -> None:
    """llguidance tokenizes the bytes a grammar forces with the callback it is given. With encode(), "{"
    comes back as "▁", "{" and the matcher allows a space the grammar forbids; with encode_continuation
    every step's allowed tokens keep the output valid. (The view mirrors onecall.sampling.grammar's.)"""
    import json

    import llguidance

    class View:
        def __init__(self, tokenize: Any) -> None:
            self.eos_token_id, self.bos_token_id = 2, 1
            self.tokens = [ours.token_bytes(i) for i in range(ours.vocab_size)]
            self.special_token_ids = sorted(ours.special_ids)
            self._tokenize = tokenize

        def __call__(self, text: str) -> list[int]:
            if not isinstance(text, str):
                raise TypeError("encode takes str")
            return list(self._tokenize(text))

    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1, 22, 333]}, "b": {"type": "boolean"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})

    def sample(tokenize: Any, seed: int) -> tuple[list[int], bool]:
        ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(View(tokenize)), eos_token=[2])
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        rng = random.Random(seed)
        out: list[int] = []
        while not matcher.is_stopped() and not matcher.is_error() and len(out) < 100:
            mask = matcher.compute_bitmask()  # one bit per id, little-endian 32-bit words
            allowed = [i for i in range(ours.vocab_size) if mask[i // 8] >> (i % 8) & 1]
            out.append(rng.choice(allowed))
            matcher.consume_token(out[-1])
        return out, matcher.is_error()

    assert sample(ours.encode, 0)[1]  # the space-prefixed tokenization derails the matcher
    for seed in range(5):
        ids, failed = sample(ours.encode_continuation, seed)
        text = ours.decode([i for i in ids if i != 2])
        assert not failed and json.loads(text)["a"] in (1, 22, 333), text


# ---- chat template ----


def test_chat_template(ours: Tokenizer, ref: Any, vocab: Any) -> None:
    messages = [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "the fox 😀"},
    ]
    assert ours.chat_template == CHAT_TEMPLATE
    rendered = render_chat(ours, messages, add_generation_prompt=True)
    assert rendered.text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.text.startswith("<s>[INST] hi there [/INST] hello</s>[INST]")
    assert rendered.token_ids == llama_cpp_tokenize(rendered.text, vocab)
    assert rendered.token_ids.count(1) == 1 and rendered.token_ids[0] == ours.bos_token_id == 1
    control = [i for i, c in zip(rendered.token_ids, rendered.is_control) if c]
    assert [ours.id_to_token(i) for i in control] == ["<s>", "[INST]", "[/INST]", "</s>", "[INST]", "[/INST]"]


# ---- refusals ----


def test_refusals(ours: Tokenizer, gguf_file: Path) -> None:
    metadata = GGUFFile(gguf_file).metadata
    with pytest.raises(UnsupportedModelError, match=r"'bert' is not supported; supported: 'gpt2'.*'llama'"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.model": "bert"})
    with pytest.raises(UnsupportedModelError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf_metadata({k: v for k, v in metadata.items() if k != "tokenizer.ggml.scores"})
    with pytest.raises(UnsupportedModelError, match="scores"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.scores": [0.0]})


# ---- end to end: a tiny random-weight llama GGUF with this vocabulary, through the public API ----


def test_engine_runs_a_sentencepiece_gguf(tmp_path: Path, vocab: Any, ours: Tokenizer) -> None:
    """Prompt ids as llama.cpp makes them (BOS added per the file), output text as decode() gives it,
    and a chat rendered with the file's template, BOS written once by the template."""
    from onecall import LLM, SamplingParams
    from tests.helpers.make_models import random_state_dict, tiny_hf_config, write_tiny_gguf

    tokens, scores, types = vocab
    config = tiny_hf_config("llama", vocab_size=len(tokens))
    metadata = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.chat_template": CHAT_TEMPLATE,
    }  # fmt: skip
    path = write_tiny_gguf(tmp_path / "spm.gguf", random_state_dict(config), config, tokenizer=metadata)
    llm = LLM(model=str(path), device="cpu")
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    out = llm.generate(["hello world 日本"], greedy)[0]
    assert out.trace is not None
    assert out.trace.prompt_token_ids == [1, *llama_cpp_tokenize("hello world 日本", vocab)]
    # the output's text continues the prompt's (the detokenizer starts after the prompt's last ids),
    # so its first word keeps the space SentencePiece marks it with
    prompt_ids = out.trace.prompt_token_ids
    continuation = ours.decode(prompt_ids + out.token_ids)[len(ours.decode(prompt_ids)) :]
    assert len(out.token_ids) == 16 and out.text == continuation
    chat = llm.chat([{"role": "user", "content": "hi there"}], greedy)[0]
    assert chat.trace is not None
    assert chat.trace.prompt_token_ids == llama_cpp_tokenize("<s>[INST] hi there [/INST]", vocab)
    chat_ids = chat.trace.prompt_token_ids
    assert chat.text == ours.decode(chat_ids + chat.token_ids)[len(ours.decode(chat_ids)) :]
    # structured outputs: the grammar's forced text is tokenized without the space prefix
    # (sampling/grammar.py uses encode_continuation), so a random model still gives valid output
    from onecall.sampling_params import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1, 22]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    so = SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputsParams(json=schema))
    structured = llm.generate(["hello"], so)[0]
    assert structured.finish_reason == "stop", structured.text
    assert json.loads(structured.text)["a"] in (1, 22)
