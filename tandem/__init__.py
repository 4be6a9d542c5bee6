"""Tandem: an LLM serving system."""

from tandem.core.sampling_params import LoRARequest, SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams"]


def __getattr__(name: str):
    # Lazy, so that the torch-free core (and the simulator) can be imported without torch.
    if name == "LLM":
        from tandem.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
