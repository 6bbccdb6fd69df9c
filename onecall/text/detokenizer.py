"""IncrementalDetokenizer: a stream of token ids -> text deltas, never half a character.

Decoding each new token alone is wrong twice over: a byte-level token may hold only part of a UTF-8
character (an emoji is often 2-4 tokens), and some decoders need the token before to get spacing right
(sentencepiece drops the leading space of the first token of a decode call). Decoding the whole output
every step is right but O(n) per token. So, like vLLM and TGI, we decode a small window:

    ids:  ... | emitted long ago | prefix_offset .. read_offset | read_offset .. end |
                                   already emitted (context)      not yet emitted

    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]   if new_text grew and does not end in U+FFFD

A trailing U+FFFD means the last bytes are an unfinished character: hold them (the window just grows)
until the rest arrives. When a delta is emitted the window slides: prefix_offset <- read_offset,
read_offset <- end. Because read_offset only moves to a point where the decoded text ended cleanly, the
deltas concatenate to exactly decode(all ids) (without context), or to the text the output adds after
its context (with it: the prompt's last ids, as vLLM seeds its window).
"""

from __future__ import annotations

from collections.abc import Sequence

from onecall.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 4  # prompt ids kept as the first window's context (enough for any decoder's spacing)


class IncrementalDetokenizer:
    """Turns token ids, one at a time, into text that is now certain."""

    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool = True, context: Sequence[int] = ()
    ) -> None:
        """`context`: the ids the output continues (the prompt's last few), decoded as the window's
        start and never emitted, so the first token's text is what it is after them: SentencePiece's
        "▁lazy" after "... the" is " lazy", where decoding it alone gives "lazy". Context whose own
        text ends in an unfinished character is dropped (the output's bytes could complete it)."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(context[-_CONTEXT_TOKENS:])
        if self._ids and self._decode(0).endswith(_REPLACEMENT):
            self._ids = []
        self._prefix_offset = 0  # start of the decode window (context already emitted)
        self._read_offset = len(self._ids)  # first id whose text has not been emitted
        self.text = ""  # everything emitted so far

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is unfinished)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """End of stream: whatever was held back, with U+FFFD for bytes that never became a character."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        delta = self._decode(self._prefix_offset)[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
