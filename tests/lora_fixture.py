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


# PEFT's module name -> llama.cpp's tensor name piece (written apart from the reader's own table)
_GGUF_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}


def write_gguf_lora(adapter: str, out: Path, arch: str, heads=(0, 0), qtype=None) -> str:
    """The PEFT adapter at `adapter` as llama.cpp's convert_lora_to_gguf.py writes it: header
    general.type adapter, adapter.type lora, adapter.lora.alpha; each pair as
    `blk.N.<tensor>.weight.lora_a` [r, in] and `.lora_b` [out, r] (numpy shapes), llama's q/k B
    rows permuted by (heads, kv heads) as its converter permutes the base's; in `qtype` (F32 when
    None), falling back to F16 where a row does not fill Q8_0 blocks, as the converter does."""
    import json
    import re

    import gguf
    from gguf_fixture import _llama_cpp_permute
    from safetensors.torch import load_file

    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"]))
    for key, tensor in load_file(f"{adapter}/adapter_model.safetensors").items():
        layer, module, which = re.search(r"layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])", key).groups()
        w = tensor.float().numpy()
        if arch == "llama" and which == "B" and module in ("q_proj", "k_proj"):
            w = _llama_cpp_permute(w, heads[module == "k_proj"])
        name = f"blk.{layer}.{_GGUF_NAMES[module]}.weight.lora_{which.lower()}"
        kind = qtype or gguf.GGMLQuantizationType.F32
        try:
            data = gguf.quants.quantize(w, kind)
        except gguf.QuantError:
            kind = gguf.GGMLQuantizationType.F16
            data = gguf.quants.quantize(w, kind)
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(out)
