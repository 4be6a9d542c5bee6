"""Tandem: an LLM serving system."""
from tandem.core.sampling_params import SamplingParams
from tandem.engine.llm import LLM

__all__ = ["LLM", "SamplingParams"]
