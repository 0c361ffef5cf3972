"""dspark: DSpark speculative decoding (semi-autoregressive drafter, confidence-scheduled verification).

The public names load on first use, so `dspark --help` and the command line's checks of its flags run without
importing torch."""
from .options import Options

__all__ = ["LLM", "Options", "RequestOutput", "SamplingParams"]
__version__ = "0.2.0"


def __getattr__(name: str):
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    if name == "RequestOutput":
        from .engine.request import RequestOutput

        return RequestOutput
    if name == "SamplingParams":
        from .sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'dspark' has no attribute {name!r}")
