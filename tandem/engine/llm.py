"""Offline batch API: `LLM(model=..., max_num_seqs=...).generate(prompts, sampling_params)`; the
keyword arguments are the engine's flat options (config/engine.py: EngineConfig.from_kwargs)."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from tandem.config import EngineConfig
from tandem.core.sampling_params import LoRARequest, SamplingParams
from tandem.engine.chat import apply_chat_template
from tandem.engine.llm_engine import LLMEngine, PromptType
from tandem.engine.output_processor import RequestOutput


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        """`model` left out: the config's default model."""
        if model is not None:
            kwargs["model"] = model
        self.engine = LLMEngine(EngineConfig.from_kwargs(**kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A bad prompt raises ValueError and
        nothing of the batch runs. `lora_request`: the adapter of every prompt, or one per
        prompt (None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        loras = (
            list(lora_request)
            if isinstance(lora_request, Sequence)
            else [lora_request] * len(prompts)
        )
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        ids = []
        try:
            for p, sp, lora in zip(prompts, sampling_params, loras):
                ids.append(self.engine.add_request(p, sp, lora_request=lora))
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the one chat prompt (as the server does), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            apply_chat_template(
                self.tokenizer, c, tools, add_generation_prompt, chat_template_kwargs
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)
