"""Byte-level BPE from GGUF metadata (`tokenizer.ggml.model` "gpt2"): GPT-2's byte alphabet, the split
regexes each `tokenizer.ggml.pre` name stands for, and the HF `tokenizers` pipeline built from them.

Each pre-tokenizer name stands for the split regexes the vocabulary was trained with (llama.cpp's
llama-vocab.cpp and the models' own tokenizer.json files):

    pre name                   splits, applied in order (each cuts the pieces of the one before)
    gpt-2, default             GPT-2: contractions, ` ?letters`, ` ?digits`, ` ?punctuation`, spaces
    smollm, starcoder, refact  every digit alone (\\p{N}), then GPT-2's
    qwen2, deepseek-r1-qwen    llama-3 shape but every digit alone; case-insensitive contractions
    qwen35                     Qwen3.5/3.6's: qwen2's with combining marks (\\p{M}) inside words, not
                               split off into punctuation pieces
    llama-bpe, llama3          digits in runs of at most 3; a piece that is a whole vocab entry is kept
    deepseek-v3                digits in runs of at most 3; then runs of CJK ideographs and kana;
                               then an ASCII punctuation mark joined to the ASCII word after it,
                               words with marks, punctuation runs (\\p{P}\\p{S}), spaces (DeepSeek-V3)
    gpt-4o                     o200k (gpt-oss): words split at case changes, with marks, contractions
                               attached; digits in runs of at most 3; a whole vocab entry is kept (as
                               tiktoken does)
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from onecall.errors import UnsupportedModelError

CONTROL, USER_DEFINED = 3, 4  # GGUF token types matched whole in text

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_BODY = r"[^\r\n\p{L}\p{N}]?\p{L}+|{digits}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|" + _LLAMA3_BODY.replace("{digits}", r"\p{N}{1,3}")
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|" + _LLAMA3_BODY.replace("{digits}", r"\p{N}")
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",  # CJK ideographs, hiragana, katakana
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_UPPER, _LOWER, _CONTRACTION = (
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]",
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
)
_O200K_SPLIT = "|".join(
    (
        rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    )
)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How one GGUF `tokenizer.ggml.pre` type cuts text before BPE."""

    splits: tuple[str, ...]  # regexes applied in order, each cutting the pieces of the previous one
    ignore_merges: bool = False  # a piece that is itself a vocab entry is taken whole (llama-3)
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_GPT2 = PreTokenizerSpec((_GPT2_SPLIT,))
_DIGITS_THEN_GPT2 = PreTokenizerSpec((r"\p{N}", _GPT2_SPLIT))
_QWEN2 = PreTokenizerSpec((_QWEN2_SPLIT,))
_LLAMA3 = PreTokenizerSpec((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
GGUF_PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "gpt-2": _GPT2, "default": _GPT2,
    "smollm": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "qwen35": PreTokenizerSpec((_QWEN35_SPLIT,)),
    "deepseek-v3": PreTokenizerSpec(_DEEPSEEK_V3_SPLITS),
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3,
    "gpt-4o": PreTokenizerSpec((_O200K_SPLIT,), ignore_merges=True),
}  # fmt: skip


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> character map used to spell byte-level vocab pieces.

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, 0x7F-0xA0, 0xAD) are moved,
    in byte order, to U+0100 onwards, so a space is spelled "Ġ" (U+0120) and a newline "Ċ" (U+010A).
    """
    table = {b: chr(b) for b in [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]}
    moved = [b for b in range(256) if b not in table]
    table.update({b: chr(0x100 + i) for i, b in enumerate(moved)})
    return table


UNICODE_TO_BYTE = {c: b for b, c in byte_alphabet().items()}


def build_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer for a GGUF `tokenizer.ggml.pre` name: its splits, then the byte-level respelling."""
    spec = GGUF_PRE_TOKENIZERS.get(pre)
    if spec is None:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(GGUF_PRE_TOKENIZERS))}"
        )
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in spec.splits]
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def byte_level_from_gguf(tokens: list[str], merges: list[str], types: list[int], pre: str) -> HFTokenizer:
    """Byte-level BPE over the vocab as spelled in the file (a duplicate piece keeps its first id), with
    control tokens as special added tokens and user-defined ones as plain added tokens."""
    pre_tokenizer = build_pre_tokenizer(pre)
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = [tuple(m.split(" ")) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise UnsupportedModelError("GGUF merges must be two pieces separated by one space")
    try:
        bpe = models.BPE(vocab, pairs, ignore_merges=GGUF_PRE_TOKENIZERS[pre].ignore_merges)  # type: ignore[arg-type]
    except Exception as e:  # tokenizers raises its own exception type for bad vocab/merges
        raise UnsupportedModelError(f"GGUF vocabulary/merges do not form a BPE model: {e}") from e
    hf = HFTokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizer  # type: ignore[assignment]
    hf.decoder = decoders.ByteLevel()  # type: ignore[assignment]
    # matched whole in text (content == vocab key keeps their ids)
    added = [(t, k == CONTROL) for t, k in zip(tokens, types, strict=True) if k in (CONTROL, USER_DEFINED)]
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ctl in added if ctl])
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t, ctl in added if not ctl])
    assert hf.get_vocab_size(with_added_tokens=True) == len(vocab), "added tokens must reuse vocab ids"
    return hf
