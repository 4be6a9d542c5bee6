"""Tiny random PEFT LoRA adapters over the tiny test models (conftest.py), made by peft itself,
and the reference: transformers + peft's PeftModel, greedy, fp32."""

from __future__ import annotations

from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: str, out: Path, seed: int, r: int = 8, targets=None, rslora: bool = False
) -> str:
    """A LoRA adapter of `base` with random A and B (so it changes the output), saved at `out`."""
    import peft
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_modules=targets or ALL,
        use_rslora=rslora,
        init_lora_weights=False,
    )
    peft.get_peft_model(model, config).save_pretrained(out)
    return str(out)


def peft_greedy(base: str, adapter: str | None, prompts, max_new_tokens: int) -> list[list[int]]:
    """transformers + PeftModel (or the base alone), one prompt at a time, greedy, fp32."""
    import peft
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs
