"""dspark: DSpark speculative decoding (semi-autoregressive drafter, confidence-scheduled verification)."""
from .engine.llm import LLM
from .engine.request import RequestOutput
from .options import Options
from .sampling import SamplingParams

__all__ = ["LLM", "Options", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
