"""Gemma 4 vocabularies from GGUF (`tokenizer.ggml.model = "gemma4"`) as a `tokenizers` pipeline.

llama.cpp's converter (convert_hf_to_gguf.py, Gemma4Model.set_vocab) writes the pieces of Gemma 4's
tokenizer.json as they are ("▁" for a space, `<0x00>`..`<0xFF>` byte pieces), a score and a type per piece,
the BPE merges (`tokenizer.ggml.merges`, "left right"), the BOS/EOS/UNK/PAD ids, `add_space_prefix = false`
and `add_bos_token = true`; no `tokenizer.ggml.pre`. It marks the chat markers that must show in output
(`<|channel>`, `<|tool_call>`, ...) user-defined (type 4), the other added tokens control (type 3).

llama.cpp (llama-vocab.cpp) loads "gemma4" as LLAMA_VOCAB_TYPE_BPE with the pre-tokenizer forced to
LLAMA_VOCAB_PRE_TYPE_GEMMA4, i.e. SentencePiece-style BPE over raw UTF-8, not GPT-2's byte alphabet:

    1. control and user-defined pieces are matched whole in the text (tokenizer_st_partition)
    2. every " " becomes "▁" (escape_whitespaces); no space is prefixed
    3. the text is split into runs of newlines and runs of everything else (regex `[^\\n]+|[\\n]+`)
    4. a newline run that is itself a piece is that piece; every other run is merged by rank from
       single characters (the BPE merge loop, byte_encode = false)
    5. a symbol that is not a piece becomes its UTF-8 bytes as `<0xNN>` pieces
    6. BOS is prepended: llama.cpp forces add_bos on for this vocabulary even where the file says false

transformers builds the same tokenizer from tokenizer.json (GemmaTokenizer: a " " -> "▁" normalizer, a
BPE model with byte fallback, a Replace/ByteFallback/Fuse decoder), where the newline runs "\\n", "\\n\\n",
... are added tokens, matched whole, which is what step 4 mimics. We build that pipeline: BPE with the
file's merges and byte fallback, the " " -> "▁" normalizer, a split isolating newline runs (step 3; on
Gemma's vocabulary, whose merges never join a newline to another character, it changes nothing), and
control/user-defined pieces as added tokens. Step 4 is made added tokens too: every piece that is a run
of newlines is matched whole. That equals llama.cpp for every newline run up to the longest such piece;
a longer run is split longest piece first here (as transformers does) where llama.cpp merges it by rank.

Decoding is onecall.text.sentencepiece's byte decoder ("▁" is a space, `<0xNN>` its byte, no prefix to
strip), equal to transformers' decoder on valid UTF-8.

Refused (UnsupportedModelError): no `tokenizer.ggml.merges`, merges that are not "left right" strings,
and `tokenizer.ggml.add_space_prefix = true` (llama.cpp's BPE path never prefixes a space, so a file
asking for one is not a Gemma 4 vocabulary we know how to reproduce).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from onecall.errors import ModelFileError, UnsupportedModelError
from onecall.text.sentencepiece import CONTROL, SPACE, UNKNOWN, USER_DEFINED, PieceBytesDecoder


def gemma4_merges(merges: Any) -> list[tuple[str, str]]:
    """`tokenizer.ggml.merges` as (left, right) pairs, split where llama.cpp splits them: at the first
    space after the first character (so a left half may itself be a space)."""
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise ModelFileError("GGUF tokenizer.ggml.merges must be an array of strings")
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        cut = merge.find(" ", 1)
        if cut < 0:
            raise UnsupportedModelError(
                f"GGUF gemma4 merge {merge!r:.40} is not two pieces joined by a space"
            )
        pairs.append((merge[:cut], merge[cut + 1 :]))
    return pairs


def build_gemma4_tokenizer(
    tokens: Sequence[str],
    merges: Any,
    types: Sequence[int],
    *,
    unk_id: int | None,
    add_space_prefix: bool,
) -> HFTokenizer:
    """The tokenizers pipeline for a "gemma4" GGUF vocabulary (see the module doc)."""
    if add_space_prefix:
        raise UnsupportedModelError(
            "GGUF gemma4 tokenizer with tokenizer.ggml.add_space_prefix = true is not supported "
            "(llama.cpp's Gemma 4 tokenizer prefixes no space)"
        )
    # 1. the model: BPE with the file's merges, byte fallback, <unk> for what even bytes cannot spell
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicate piece keeps its first id, as in llama.cpp's token_to_id
    unk = tokens[unk_id] if unk_id is not None else None
    try:
        bpe = models.BPE(
            vocab,  # type: ignore[arg-type]
            gemma4_merges(merges),  # type: ignore[arg-type]
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    except (ModelFileError, UnsupportedModelError):
        raise
    except Exception as e:  # tokenizers raises its own exception type for a bad vocabulary
        raise UnsupportedModelError(f"GGUF gemma4 vocabulary does not form a model: {e}") from e
    hf = HFTokenizer(bpe)

    # 2. " " -> "▁", newline runs apart from the rest; and back to bytes
    hf.normalizer = normalizers.Replace(" ", SPACE)  # type: ignore[assignment]
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")  # type: ignore[assignment]
    hf.decoder = decoders.Decoder.custom(PieceBytesDecoder(strip_space_prefix=False))

    # 3. pieces matched whole (content == vocab key, so they keep their ids): control and unknown pieces
    # (special), user-defined ones and newline runs (plain)
    special = [t for t, k in zip(tokens, types, strict=True) if t and k in (CONTROL, UNKNOWN)]
    plain = [
        t
        for t, k in zip(tokens, types, strict=True)
        if t and (k == USER_DEFINED or (k not in (CONTROL, UNKNOWN) and t.strip("\n") == ""))
    ]
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    assert hf.get_vocab_size(with_added_tokens=True) == len(vocab), "added tokens must reuse vocab ids"
    return hf
