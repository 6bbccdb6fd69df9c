"""Gemma 4 ("gemma4") GGUF tokenizers: a tiny GGUF written as llama.cpp's converter writes one, read by
onecall and compared with the reference: a `tokenizers` pipeline built the way transformers' GemmaTokenizer
builds Gemma's tokenizer.json (" " -> "▁" normalizer, BPE with the same merges and byte fallback, added
tokens for the control, user-defined and newline-run pieces, a Replace/ByteFallback/Fuse decoder).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFValueType, GGUFWriter
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from onecall.errors import ModelFileError, UnsupportedModelError
from onecall.formats.gguf import GGUFFile
from onecall.text.sentencepiece import SPACE
from onecall.text.tokenizer import Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
HEAD = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<|channel>"]
HEAD_TYPES = [CONTROL, CONTROL, CONTROL, UNKNOWN, CONTROL, CONTROL, CONTROL, USER_DEFINED]
NEWLINES = ["\n", "\n\n", "\n\n\n"]
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "Hello World! tokenizers say hi there; 12345 and 3.14 and 1,000,000.",
    "  indented code:\n    return x + y  # comment\n",
    "日本語のテキスト café naïve déjà vu",
    "user\nmodel\nthe end",
] * 3
TEXTS = [
    "hello world", "Hello World", "the quick brown fox jumps over the lazy dog", "hi", " hello",
    "  hello", "   ", " ", "hello  world", "hello world  ", "a  b   c    d", "\n", "\n\n", "\n\n\n",
    "\n\nthe", "line one\nline two\r\n\tthe end", "hello\n world", "a\n\n\n\nb", "x\n \ny",
    "12345", "3.14 and 1,000,000", "x1y22z333", "日本語のテキスト", "café naïve", "emoji 😀👍🏽 flag 🇫🇷",
    "mixed 日本 text 🎉!", "<bos>hello<eos>", "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "a<unk>b", "x<|channel>thought<channel|>y", "<mask> trailing", "< bos> not a control", "",
]  # fmt: skip


def gemma4_vocab() -> tuple[list[str], list[int], list[str]]:
    """Tokens, types and merges: the control/user-defined head, the 256 byte pieces, newline runs, then a
    BPE vocabulary trained on CORPUS with spaces written as "▁" and newline runs kept apart."""
    trainer_tok = HFTokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Replace(" ", SPACE)  # type: ignore[assignment]
    trainer_tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")  # type: ignore[assignment]
    trainer_tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    spec = json.loads(trainer_tok.to_str())["model"]
    learned = [t for t, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    tokens = [*HEAD, *(f"<0x{b:02X}>" for b in range(256)), *NEWLINES]
    types = [*HEAD_TYPES, *[BYTE] * 256, *[NORMAL] * len(NEWLINES)]
    for t in learned:
        if t not in tokens:
            tokens.append(t)
            types.append(NORMAL)
    tokens.append("<channel|>")
    types.append(USER_DEFINED)
    return tokens, types, merges


def write_gemma4_gguf(path: Path, vocab: tuple[list[str], list[int], list[str]], **flags: Any) -> Path:
    """The tokenizer keys Gemma4Model.set_vocab writes: model "gemma4", tokens, scores, token types,
    merges, special ids, add_space_prefix false, add_bos_token true (no tokenizer.ggml.pre)."""
    writer = GGUFWriter(str(path), "gemma4")
    add_gemma4_tokenizer(writer, vocab, **flags)
    writer.add_tensor("token_embd.weight", np.zeros((len(vocab[0]), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_gemma4_tokenizer(
    writer: GGUFWriter, vocab: tuple[list[str], list[int], list[str]], **flags: Any
) -> None:
    """write_gemma4_gguf's tokenizer keys, into an open writer (a whole model's file too)."""
    tokens, types, merges = vocab
    writer.add_string("tokenizer.ggml.model", "gemma4")
    writer.add_key_value("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY)
    scores = [-1000.0 if k == CONTROL else 0.0 for k in types]
    writer.add_key_value("tokenizer.ggml.scores", scores, GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
    writer.add_key_value(
        "tokenizer.ggml.token_type", types, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32
    )
    writer.add_key_value("tokenizer.ggml.merges", merges, GGUFValueType.ARRAY)
    for key, token in (("bos", "<bos>"), ("eos", "<eos>"), ("unknown", "<unk>"), ("padding", "<pad>")):
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", tokens.index(token))
    writer.add_bool("tokenizer.ggml.add_space_prefix", bool(flags.get("add_space_prefix", False)))
    writer.add_bool("tokenizer.ggml.add_bos_token", bool(flags.get("add_bos_token", True)))


def reference(vocab: tuple[list[str], list[int], list[str]]) -> HFTokenizer:
    """Gemma's tokenizer.json for this vocabulary, as transformers' GemmaTokenizer builds it, saved and
    reloaded as JSON."""
    tokens, types, merges = vocab
    ids = {t: i for i, t in enumerate(tokens)}
    hf = HFTokenizer(
        models.BPE(
            ids,
            [tuple(m.split(" ", 1)) for m in merges],
            unk_token="<unk>",
            fuse_unk=True,
            byte_fallback=True,
        )  # type: ignore[arg-type]
    )
    hf.normalizer = normalizers.Replace(" ", SPACE)  # type: ignore[assignment]
    hf.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")  # type: ignore[assignment]
    hf.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])  # type: ignore[assignment]
    hf.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types)
            if k in (CONTROL, UNKNOWN)
        ]
    )
    hf.add_tokens(
        [AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED or t in NEWLINES]
    )
    return HFTokenizer.from_str(hf.to_str())


@pytest.fixture(scope="module")
def vocab() -> tuple[list[str], list[int], list[str]]:
    return gemma4_vocab()


@pytest.fixture(scope="module")
def tok(vocab: tuple[list[str], list[int], list[str]], tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = write_gemma4_gguf(tmp_path_factory.mktemp("g4") / "gemma4.gguf", vocab)
    return Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_reference(
    tok: Tokenizer, vocab: tuple[list[str], list[int], list[str]], text: str
) -> None:
    ref = reference(vocab)
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, add_special_tokens=True) == [2, *ref.encode(text, add_special_tokens=False).ids]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tok: Tokenizer, vocab: tuple[list[str], list[int], list[str]], text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids, skip_special_tokens=False) == reference(vocab).decode(
        ids, skip_special_tokens=False
    )
    assert tok.encode_continuation(text) == ids  # no space prefix to leave out


def test_pieces_and_special_ids(tok: Tokenizer, vocab: tuple[list[str], list[int], list[str]]) -> None:
    tokens = vocab[0]
    hello = tok.encode(" hello")
    assert [tok.id_to_token(i) for i in hello][0].startswith(SPACE)  # "▁", not GPT-2's "Ġ"
    assert b"".join(tok.token_bytes(i) for i in tok.encode("日本 😀")) == "日本 😀".encode()
    assert tok.encode("😀")[0] == tokens.index("<0xF0>")  # byte fallback
    assert tok.encode("\n\n\n") == [tokens.index("\n\n\n")]
    assert tok.bos_token_id == 2 and tok.eos_token_ids == {1} and tok.add_bos_token
    assert {0, 1, 2, 3, 5, 6} <= tok.special_ids and tokens.index("<|channel>") not in tok.special_ids
    # control tokens drop out of decoded text, user-defined ones stay
    ids = tok.encode("<start_of_turn>model\n<|channel>hi<end_of_turn>")
    assert tok.decode(ids) == "model\n<|channel>hi"


def test_add_bos_forced_like_llama_cpp(vocab: tuple[list[str], list[int], list[str]], tmp_path: Path) -> None:
    path = write_gemma4_gguf(tmp_path / "nobos.gguf", vocab, add_bos_token=False)
    tok = Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)
    assert tok.add_bos_token and tok.encode("hi", add_special_tokens=True)[0] == 2


def test_refusals(vocab: tuple[list[str], list[int], list[str]], tmp_path: Path) -> None:
    metadata = GGUFFile(write_gemma4_gguf(tmp_path / "g.gguf", vocab)).metadata
    with pytest.raises(UnsupportedModelError, match="merges"):
        Tokenizer.from_gguf_metadata({k: v for k, v in metadata.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(UnsupportedModelError, match="add_space_prefix"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.add_space_prefix": True})
    with pytest.raises(UnsupportedModelError, match="merge"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.merges": ["nospace"]})
    with pytest.raises(ModelFileError, match="merges"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.merges": [1, 2]})
