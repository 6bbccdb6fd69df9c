"""SentencePiece vocabularies from GGUF (`tokenizer.ggml.model = "llama"`) as a `tokenizers` pipeline.

Llama-2, Mistral and many other GGUFs carry a SentencePiece BPE vocabulary: pieces spelled with "▁" for a
space, a score per piece, and the 256 byte pieces `<0x00>`..`<0xFF>` for characters the vocabulary lacks.
llama.cpp (llama-vocab.cpp, llm_tokenizer_spm) tokenizes one run of plain text like this:

    1. prefix a space when the run starts the text or follows a matched control/user-defined token
       (only if `tokenizer.ggml.add_space_prefix`, default true), then write every " " as "▁"
    2. start from single characters; repeatedly join the adjacent pair whose concatenation is a piece
       with the highest score (ties: the leftmost pair)
    3. a symbol that is not a piece (a character the vocabulary lacks) becomes its UTF-8 bytes as
       `<0xNN>` pieces

Step 2 is exactly a BPE whose merge list is every split (left, right) of every piece into two pieces,
ranked by the joined piece's score, best first: BPE also joins the best-ranked adjacent pair, leftmost
first among equals. So, as transformers' GGUF converter does, we hand `tokenizers` a BPE model with
those merges and byte fallback, which keeps encoding in Rust. The one case where the two can differ is
two *different* pieces with the same score both joinable at once: llama.cpp takes the leftmost pair, BPE
the one ranked first. There we rank as transformers does (see spm_merges) and so agree with it, not
with llama.cpp; vocabularies trained by sentencepiece give their normal pieces distinct scores.

Step 1 is a normalizer that prepends "▁" and replaces " " by "▁". `tokenizers` applies it to each run of
text between added tokens (control and user-defined pieces are added tokens, matched whole), so every
run gets the prefix, as in llama.cpp.

llama.cpp and transformers differ on step 1, and we follow llama.cpp. transformers (5.x, legacy=False)
builds a `Metaspace(prepend_scheme="first")` pre-tokenizer instead, which adds no "▁" to text that
already starts with a space (" hi" -> "▁hi", where llama.cpp and the sentencepiece library give
"▁▁hi") nor to text after an added token ("[INST] hi" -> "[INST]", "▁hi" here; "[INST]", "hi" there).
llama.cpp's choice is the one the models were trained and chat-formatted with: it is what the
sentencepiece library does to plain text, what Meta's Llama-2 reference code produces for
`<s>[INST] ...`, and what Llama-2's and Mistral's own tokenizer.json files (legacy normalizers) produce.

Decoding joins the bytes of the pieces ("▁" is a space, `<0xNN>` its byte), reads them as UTF-8 with
U+FFFD for invalid bytes, and, when a space prefix is added on encode, removes one leading space (as
transformers' decoder and llama.cpp's llama_detokenize do), so decode(encode(text)) == text. Invalid
bytes are where we follow llama.cpp, whose pieces are bytes, over transformers: its ByteFallback decoder
turns a whole run of byte pieces into one U+FFFD per piece when any of them is invalid ("?" + a lone
0xE8 -> "\ufffd\ufffd" there, "?\ufffd" here). Decoding bytes keeps decode(a + b) an extension of
decode(a) wherever a ends on a whole character, which the incremental detokenizer relies on. The
decoder is a Python object (PieceBytesDecoder), so this pipeline cannot be saved as a tokenizer.json.

Text that continues other text (a grammar engine forcing "{" mid-output) must not get the prefix:
without_space_prefix builds the same model with only the " " -> "▁" normalizer, for
Tokenizer.encode_continuation.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

from onecall.errors import UnsupportedModelError

SPACE = "\u2581"  # "▁", SentencePiece's visible space
# GGUF token types (llama.cpp's llama_token_type; the others: 1 normal, 5 unused, 6 byte)
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4


def spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of every piece into two pieces, ranked best first (SentencePiece's step 2 as BPE).

    Rank key: the joined piece's score, higher first; among equal scores, the longer left half, then the
    longer right half, then the joined piece's id and the halves' ids. That is the order transformers'
    generate_merges gives, so the two agree even on a vocabulary with tied scores.
    """
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicate piece keeps its first id, as in llama.cpp's token_to_id
    ranked: list[tuple[float, int, int, int, int, int, str, str]] = []
    for piece, i in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                key = (-scores[i], -len(left), -len(right), i, vocab[left], vocab[right])
                ranked.append((*key, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_spm_tokenizer(
    tokens: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    *,
    unk_id: int | None,
    add_space_prefix: bool,
) -> HFTokenizer:
    """The tokenizers pipeline for a SentencePiece GGUF vocabulary (see the module doc).

    Control and unknown pieces become special added tokens, user-defined ones plain added tokens: all are
    matched whole in text (llama.cpp's tokenizer_st_partition), and each keeps its vocabulary id.
    """
    # 1. the model: BPE with score-ranked merges, byte fallback, <unk> for what even bytes cannot spell
    if len(scores) != len(tokens):
        raise UnsupportedModelError(f"GGUF has {len(tokens)} tokens but {len(scores)} scores")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk = tokens[unk_id] if unk_id is not None else None
    try:
        bpe = models.BPE(
            vocab,  # type: ignore[arg-type]
            spm_merges(tokens, scores),  # type: ignore[arg-type]
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    except Exception as e:  # tokenizers raises its own exception type for a bad vocabulary
        raise UnsupportedModelError(f"GGUF SentencePiece vocabulary does not form a model: {e}") from e
    hf = HFTokenizer(bpe)

    # 2. text -> "▁"-spelled text, per run between added tokens; and back
    spaces = [normalizers.Replace(" ", SPACE)]
    hf.normalizer = normalizers.Sequence(  # type: ignore[assignment]
        [normalizers.Prepend(SPACE), *spaces] if add_space_prefix else spaces
    )
    hf.decoder = decoders.Decoder.custom(PieceBytesDecoder(strip_space_prefix=add_space_prefix))

    # 3. pieces matched whole (content == vocab key, so they keep their ids)
    special = [t for t, k in zip(tokens, types, strict=True) if t and k in (CONTROL, UNKNOWN)]
    plain = [t for t, k in zip(tokens, types, strict=True) if t and k == USER_DEFINED]
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    assert hf.get_vocab_size(with_added_tokens=True) == len(vocab), "added tokens must reuse vocab ids"
    return hf


def without_space_prefix(hf: HFTokenizer) -> HFTokenizer:
    """The same model and added tokens, spaces written as "▁" but no "▁" prefixed: for text that
    continues other text (Tokenizer.encode_continuation). Encoding only: it has no decoder."""
    continuation = HFTokenizer(hf.model)  # shares the model, merges are not rebuilt
    continuation.normalizer = normalizers.Replace(" ", SPACE)  # type: ignore[assignment]
    added = hf.get_added_tokens_decoder()  # all are vocab pieces (build_spm_tokenizer), so order is free
    continuation.add_special_tokens([t for t in added.values() if t.special])
    continuation.add_tokens([t for t in added.values() if not t.special])
    assert all(continuation.token_to_id(t.content) == i for i, t in added.items()), "ids must be kept"
    return continuation


class PieceBytesDecoder:
    """A `tokenizers` custom decoder: pieces -> their bytes -> text (see the module doc)."""

    def __init__(self, strip_space_prefix: bool) -> None:
        self.strip_space_prefix = strip_space_prefix

    def decode_chain(self, pieces: list[str]) -> list[str]:
        text = b"".join(map(piece_bytes, pieces)).decode("utf-8", errors="replace")
        if self.strip_space_prefix and text.startswith(" "):
            text = text[1:]
        return [text]


def _is_byte_piece(piece: str) -> bool:
    """`<0xNN>`: the piece for one byte that byte fallback spells a missing character with."""
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">") and _is_hex(piece[3:5])


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in text)


def piece_bytes(piece: str) -> bytes:
    """The bytes a SentencePiece vocab piece stands for: a byte piece's byte, else its text with "▁" -> " "."""
    if _is_byte_piece(piece):
        return bytes([int(piece[3:5], 16)])
    return piece.replace(SPACE, " ").encode()
