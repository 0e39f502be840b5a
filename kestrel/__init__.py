"""Kestrel: an inference engine for the Kimi hybrid models (Kimi Linear, Kimi K3)."""

from kestrel.errors import KestrelError
from kestrel.llm import LLM
from kestrel.runtime.engine import RequestOutput
from kestrel.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "KestrelError"]
__version__ = "0.1.0"
