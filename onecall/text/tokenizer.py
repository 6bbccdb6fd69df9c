"""Tokenizer: Hugging Face `tokenizers` for encode/decode, plus the control-token facts the engine needs.

Two sources, both read as plain data (JSON or GGUF key/values; nothing from a model folder is executed):

- `from_hf_folder`: tokenizer.json, with tokenizer_config.json (BOS/EOS strings, add_bos_token, chat
  template, special flags) and generation_config.json (extra EOS ids).
- `from_gguf_metadata`: llama.cpp's `tokenizer.ggml.*` keys. A GGUF stores no pipeline, only a vocabulary,
  merges or scores, per-token types and a pre-tokenizer *name*; we rebuild the pipeline from them.
  `tokenizer.ggml.model` says which: "llama" is SentencePiece BPE (Llama-2, Mistral; built in
  onecall.text.sentencepiece), "gpt2" byte-level BPE (onecall.text.byte_level: the pre-tokenizer name
  picks the split regexes), "gemma4" Gemma 4's SentencePiece-style BPE over raw UTF-8 with merges
  (onecall.text.gemma4).

Control tokens (GGUF type 3; for SentencePiece also the unknown token, type 2) become special added
tokens and user-defined ones (type 4, e.g. `<think>`) plain added tokens, so both are matched atomically
in text, never spelled out of smaller pieces.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from tokenizers import Tokenizer as HFTokenizer

from onecall.errors import InvalidParameterError, ModelFileError, ModelNotFoundError, UnsupportedModelError
from onecall.text.byte_level import GGUF_PRE_TOKENIZERS, UNICODE_TO_BYTE, byte_level_from_gguf
from onecall.text.gemma4 import build_gemma4_tokenizer
from onecall.text.sentencepiece import build_spm_tokenizer, piece_bytes, without_space_prefix

# How a vocab piece maps to bytes: GPT-2's byte alphabet, sentencepiece's "▁"/"<0xNN>", or neither.
PieceMode = Literal["byte_level", "sentencepiece", "plain"]

_UNKNOWN, _CONTROL = 2, 3  # GGUF token types (1 normal, 4 user-defined, 5 unused, 6 byte)
# tokenizer.ggml.model values we rebuild, and what they are
_GGUF_TOKENIZER_MODELS = {
    "gpt2": "byte-level BPE",
    "llama": "SentencePiece BPE",
    "gemma4": "Gemma 4 SentencePiece-style BPE",
}


class Tokenizer:
    """Encode/decode text and name the ids that are control tokens or end generation."""

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
        eos_token_id: int | None,
        special_ids: frozenset[int],
        add_bos_token: bool,
        chat_template: str | None,
        piece_mode: PieceMode,
        continuation: HFTokenizer | None = None,
    ) -> None:
        self._hf = hf
        # the same model without a SentencePiece space prefix (None: hf adds none): encode_continuation
        self._hf_continuation = continuation or hf
        self.vocab_size: int = max(hf.get_vocab(with_added_tokens=True).values()) + 1
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        # bos/eos are control tokens by role even where a file forgot to mark them
        bos_ids = {bos_token_id} if bos_token_id is not None else set()
        self.special_ids = special_ids | eos_token_ids | bos_ids
        self.bos_token: str | None = hf.id_to_token(bos_token_id) if bos_token_id is not None else None
        self.eos_token: str | None = hf.id_to_token(eos_token_id) if eos_token_id is not None else None
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.chat_template = chat_template
        self._piece_mode = piece_mode

    # ---- encode / decode ----

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Control tokens written in the text are matched whole; BOS is prepended only
        with add_special_tokens=True and a tokenizer that asks for it."""
        ids: list[int] = self._hf.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            assert self.bos_token_id is not None
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_continuation(self, text: str) -> list[int]:
        """Token ids of `text` where it continues other text, as a grammar engine forcing text mid-output
        asks: like encode(), but without the space a SentencePiece tokenizer prefixes to a text's start
        ("{" -> "{", not "▁{"). The same as encode() for byte-level tokenizers."""
        return list(self._hf_continuation.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 come out as U+FFFD."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return str(self._hf.decode(list(ids), skip_special_tokens=False))

    def id_to_token(self, token_id: int) -> str:
        """The raw vocab piece, e.g. "Ġthe"."""
        piece = self._hf.id_to_token(token_id)
        if piece is None:
            raise InvalidParameterError(
                "token_id", f"{token_id} is not in the vocabulary [0, {self.vocab_size})"
            )
        return str(piece)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for (a piece may hold part of a UTF-8 character)."""
        piece = self.id_to_token(token_id)
        if self._piece_mode == "byte_level":
            # added tokens written outside the byte alphabet (e.g. with a real space) stand for their UTF-8
            if all(c in UNICODE_TO_BYTE for c in piece):
                return bytes(UNICODE_TO_BYTE[c] for c in piece)
            return piece.encode()
        if self._piece_mode == "sentencepiece":
            return piece_bytes(piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    # ---- loading ----

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Rebuild the tokenizer a GGUF's `tokenizer.ggml.*` metadata describes: byte-level BPE ("gpt2",
        see the module doc), SentencePiece ("llama", see onecall.text.sentencepiece) or Gemma 4's BPE
        ("gemma4", see onecall.text.gemma4)."""
        # 1. what kind of tokenizer, and its pieces
        kind = metadata.get("tokenizer.ggml.model")
        if not isinstance(kind, str) or kind not in _GGUF_TOKENIZER_MODELS:
            raise UnsupportedModelError(
                f"GGUF tokenizer model {kind!r} is not supported; supported: "
                + ", ".join(f"{k!r} ({v})" for k, v in _GGUF_TOKENIZER_MODELS.items())
            )
        tokens: list[str] = _required(metadata, "tokenizer.ggml.tokens")
        types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise ModelFileError("GGUF tokenizer.ggml.tokens must be an array of strings")
        if not isinstance(types, list) or not all(isinstance(t, int) for t in types):
            raise ModelFileError("GGUF tokenizer.ggml.token_type must be an array of integers")
        if len(types) != len(tokens):
            raise UnsupportedModelError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")

        def token_id(key: str) -> int | None:
            value = metadata.get(f"tokenizer.ggml.{key}")
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool)):
                raise ModelFileError(f"GGUF tokenizer.ggml.{key} must be an integer, got {value!r:.40}")
            return value if value is not None and 0 <= value < len(tokens) else None

        # 2. the pipeline, and the defaults llama.cpp takes for each kind when a flag is absent
        piece_mode: PieceMode
        special_types: tuple[int, ...]  # GGUF token types that are control tokens by role
        if kind == "llama":
            hf = build_spm_tokenizer(
                tokens,
                _required(metadata, "tokenizer.ggml.scores"),
                types,
                unk_id=token_id("unknown_token_id"),
                add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
            )
            continuation = without_space_prefix(hf)
            # <unk> is special too: llama.cpp matches it in text and drops it on decode, as transformers does
            special_types, default_add_bos, piece_mode = (_CONTROL, _UNKNOWN), True, "sentencepiece"
        elif kind == "gemma4":
            hf = build_gemma4_tokenizer(
                tokens,
                _required(metadata, "tokenizer.ggml.merges"),
                types,
                unk_id=token_id("unknown_token_id"),
                add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", False)),
            )
            continuation = None  # no space prefix, so text continues as it starts
            special_types, default_add_bos, piece_mode = (_CONTROL, _UNKNOWN), True, "sentencepiece"
        else:
            pre = str(metadata.get("tokenizer.ggml.pre", "default"))
            hf = byte_level_from_gguf(tokens, _required(metadata, "tokenizer.ggml.merges"), types, pre)
            continuation = None
            special_types, piece_mode = (_CONTROL,), "byte_level"
            default_add_bos = GGUF_PRE_TOKENIZERS[pre].add_bos

        # 3. the ids that matter to the engine
        eos_id = token_id("eos_token_id")
        eos_ids = {i for i in (eos_id, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None}
        return cls(
            hf,
            bos_token_id=token_id("bos_token_id"),
            eos_token_ids=frozenset(eos_ids),
            eos_token_id=eos_id,
            special_ids=frozenset(i for i, k in enumerate(types) if k in special_types),
            # llama.cpp forces BOS on for "gemma4" whatever the file says (llama-vocab.cpp, PR 21500)
            add_bos_token=kind == "gemma4"
            or bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)),
            chat_template=metadata.get("tokenizer.chat_template"),
            piece_mode=piece_mode,
            continuation=continuation,
        )

    @classmethod
    def from_hf_folder(cls, path: Path) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, generation_config.json, chat_template.jinja)."""
        # 1. the pipeline itself
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelNotFoundError(f"{path} has no tokenizer.json, the tokenizer file onecall reads")
        spec = _read_json(tokenizer_file)
        try:
            hf = HFTokenizer.from_str(json.dumps(spec))
        except Exception as e:  # tokenizers raises its own exception type
            raise UnsupportedModelError(f"{tokenizer_file} is not a valid tokenizer: {e}") from e
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")

        # 2. BOS / EOS: strings from the tokenizer config, extra EOS ids from the generation config
        def id_of(value: Any) -> int | None:
            content = value.get("content") if isinstance(value, dict) else value
            return hf.token_to_id(content) if isinstance(content, str) else None

        bos_id = id_of(config.get("bos_token"))
        if bos_id is None and isinstance(generation.get("bos_token_id"), int):
            bos_id = generation["bos_token_id"]
        eos_id = id_of(config.get("eos_token"))
        gen_eos = generation.get("eos_token_id")
        gen_eos_ids = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        eos_ids = {i for i in [eos_id, *gen_eos_ids] if isinstance(i, int)}
        if eos_id is None and eos_ids:
            eos_id = min(eos_ids)

        # 3. special flags from both files, BOS policy, chat template
        special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            if isinstance(entry, dict) and entry.get("special"):
                special.add(int(key))
        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):  # no flag: does tokenizer.json's post-processor prepend BOS?
            with_special = hf.encode("a", add_special_tokens=True).ids[:1]
            without = hf.encode("a", add_special_tokens=False).ids[:1]
            add_bos = bos_id is not None and with_special == [bos_id] and without != [bos_id]
        return cls(
            hf,
            bos_token_id=bos_id,
            eos_token_ids=frozenset(eos_ids),
            eos_token_id=eos_id,
            special_ids=frozenset(special),
            add_bos_token=add_bos,
            chat_template=_hf_chat_template(path, config),
            piece_mode=_piece_mode(spec.get("decoder")),
            continuation=_without_space_prefix(spec),
        )


def _required(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise UnsupportedModelError(f"GGUF metadata has no {key!r}, so its tokenizer cannot be built")
    return metadata[key]


def _read_json(file: Path) -> dict[str, Any]:
    """A JSON object from `file`, or {} when the file is absent."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnsupportedModelError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{file} must hold a JSON object")
    return data


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja if present, else tokenizer_config's (a list of named templates: "default"),
    else chat_template.json's (where a multimodal model's processor keeps it)."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (path / "chat_template.json").is_file():
        template = _read_json(path / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None


def _without_space_prefix(spec: dict[str, Any]) -> HFTokenizer | None:
    """tokenizer.json's pipeline without its SentencePiece space prefix (a "▁" Prepend normalizer, or a
    Metaspace pre-tokenizer's prepend scheme), or None when it adds none."""
    changed = False

    def is_prefix(node: Any) -> bool:
        return isinstance(node, dict) and node.get("type") == "Prepend" and node.get("prepend") == "\u2581"

    def strip(node: Any) -> Any:
        nonlocal changed
        if isinstance(node, list):  # a Sequence's members
            kept = [strip(n) for n in node if not is_prefix(n)]
            changed |= len(kept) != len(node)
            return kept
        if isinstance(node, dict):
            if is_prefix(node):  # the normalizer alone
                changed = True
                return None
            if node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") != "never":
                changed = True
                return {**node, "prepend_scheme": "never", "add_prefix_space": False}
            return {k: strip(v) if k in ("normalizers", "pretokenizers") else v for k, v in node.items()}
        return node

    stripped = {
        **spec,
        "normalizer": strip(spec.get("normalizer")),
        "pre_tokenizer": strip(spec.get("pre_tokenizer")),
    }
    return HFTokenizer.from_str(json.dumps(stripped)) if changed else None


def _piece_mode(decoder: Any) -> PieceMode:
    """Read from tokenizer.json's decoder: how a vocab piece spells its bytes."""
    parts = decoder.get("decoders", [decoder]) if isinstance(decoder, dict) else []
    kinds = {p.get("type") for p in parts if isinstance(p, dict)}
    if "ByteLevel" in kinds:
        return "byte_level"
    if kinds & {"ByteFallback", "Metaspace"}:
        return "sentencepiece"
    return "plain"
