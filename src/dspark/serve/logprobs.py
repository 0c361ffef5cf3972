"""Log-probabilities in OpenAI's shapes: chat's {"content": [{"token", "logprob", "bytes", "top_logprobs"}]} and
completions' {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, from the engine's (token id, log-probability,
alternatives) entries. A token's bytes are its own (a byte-level BPE token can hold part of a character); its text
is those bytes decoded, with U+FFFD for an incomplete character."""
from __future__ import annotations

import functools


@functools.cache
def byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable alphabet, inverted: each of the 256 bytes is written as one character (printable
    Latin-1 bytes as themselves, the others as the characters from U+0100 on, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """Bytes and text of token ids under one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @functools.lru_cache(maxsize=65536)
    def bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        alphabet = byte_alphabet()
        if isinstance(piece, str) and piece and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return self.tokenizer.decode([token_id]).encode()  # not a byte-level token (special, or another scheme)

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")

    def chat(self, entries) -> dict:
        def one(token_id, logprob):
            return {"token": self.text(token_id), "logprob": logprob, "bytes": list(self.bytes(token_id))}
        return {"content": [{**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in top]} for t, lp, top in entries]}

    def completion(self, entries, offset: int = 0) -> dict:
        tokens = [self.text(t) for t, _, _ in entries]
        offsets, at = [], offset
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{self.text(a): alp for a, alp in top} for _, _, top in entries],
                "text_offset": offsets}
