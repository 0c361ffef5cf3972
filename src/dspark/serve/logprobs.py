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
    """Bytes and text of token ids under one tokenizer: byte-level BPE pieces through its alphabet, SentencePiece
    byte pieces (<0xNN>) as their byte, other pieces as the text they stand for."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        probe = tokenizer.convert_ids_to_tokens(tokenizer.encode(" a b", add_special_tokens=False))
        self.byte_level = any(isinstance(p, str) and p.startswith("Ġ") for p in probe)  # a space is Ġ there

    @functools.lru_cache(maxsize=65536)
    def bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str) or not piece:
            return self.tokenizer.decode([token_id]).encode()
        alphabet = byte_alphabet()
        if self.byte_level and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return self.tokenizer.convert_tokens_to_string([piece]).encode()

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
