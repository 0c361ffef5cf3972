"""Step 6 of the data path: append committed tokens, detect EOS / length / stop strings, and work out
the text to stream (holding back a partial UTF-8 character or a possible start of a stop string). A text
never ends in a broken character: bytes still incomplete when the request finishes are dropped."""
from __future__ import annotations

from .request import Request, Status


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of text that must wait: a partial character or a stop string's prefix."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                hold = max(hold, n)
                break
    return hold


def append_tokens(req: Request, tokens: list[int], tokenizer, eos_ids: set[int], max_model_len: int) -> str:
    """Commit `tokens` to req's output, finish it if due, and return the new text to stream."""
    params = req.params
    for token in tokens:
        req.output_ids.append(token)
        if token in eos_ids and not params.ignore_eos:
            req.finish_reason = "stop"
        elif len(req.output_ids) >= params.max_tokens or len(req.prompt_ids) + len(req.output_ids) >= max_model_len:
            req.finish_reason = "length"
        if req.finish_reason:
            break
    text = tokenizer.decode(req.output_ids, skip_special_tokens=True)
    cut = min((i for i in (text.find(s) for s in params.stop) if i >= 0), default=-1)
    if cut >= 0:
        text, req.finish_reason = text[:cut], "stop"
    if req.finish_reason:
        req.status = Status.FINISHED
        text = text.rstrip("\ufffd")  # bytes of a character cut off by the end never complete: they are dropped
    req.text = text
    safe = len(text) if req.finished else len(text) - held_back(text, params.stop)
    delta = text[req.emitted:safe]
    req.emitted = max(req.emitted, safe)
    return delta
