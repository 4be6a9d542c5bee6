"""`tandem random-gguf`: a random-weight Llama-architecture GGUF of a named shape (or a Qwen3-MoE
one: every layer's MLP a set of routed experts), for loading and speed figures on models past
the shipped one's size; the weights are noise, so none worth shipping exist. The vocabulary is
the default model's (its GGUF's tokenizer metadata is copied), so prompts tokenise and outputs
detokenise as with a real model. Tensors are drawn and written one at a time: peak memory is
the largest tensor, not the model (a 3B F16 file is ~6 GB; the MoE shape's expert tensors are
0.4 GB each in F16, drawn in fp32).
`--quantize TYPE` then runs llama.cpp's `llama-quantize` on the written file."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

from tandem.bench.llamacpp import llama_cpp_tool

WEIGHT_STD = 0.02  # as Llama's initialiser: activations stay finite through every layer
_FLOAT_TYPES = {
    "F16": (np.float16, LlamaFileType.MOSTLY_F16),
    "F32": (np.float32, LlamaFileType.ALL_F32),
}


@dataclass(frozen=True, slots=True)
class Shape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    context_length: int = 8192
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    head_size: int | None = None  # None: hidden_size // num_heads
    # a Qwen3-MoE layout (QK-norm, every layer sparse): experts per layer, chosen per token, and
    # one expert's intermediate width; 0 experts: a dense Llama
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def arch(self) -> str:
        return "qwen3moe" if self.num_experts else "llama"


SHAPES: dict[str, Shape] = {
    "tiny": Shape(64, 128, 2, 4, 2, context_length=2048),  # for tests: seconds to write and load
    # Llama-3.2-1B's dims: ~1.07B params with a 49,152 vocab; 32k positions for the long-context
    # benches (its own 128k come by llama3 RoPE scaling)
    "1b": Shape(2048, 8192, 16, 32, 8, context_length=32768),
    "3b": Shape(3072, 8192, 28, 24, 8),  # Llama-3.2-3B's dims: ~2.97B params with a 49,152 vocab
    "tiny-moe": Shape(  # for tests: the MoE layout at the tiny widths
        64,
        128,
        2,
        4,
        2,
        context_length=2048,
        head_size=32,
        num_experts=8,
        experts_per_token=2,
        expert_size=32,
    ),
    # quality figures per GGUF type: rows of 256, so llama-quantize writes the K types it names
    "small-moe": Shape(
        256,
        512,
        2,
        4,
        2,
        context_length=2048,
        head_size=64,
        num_experts=8,
        experts_per_token=2,
        expert_size=256,
    ),
    # Qwen3-30B-A3B's widths and experts at 24 layers: ~15.0B params, ~1.46B read per token
    "moe-15b-a1.5b": Shape(
        2048,
        6144,
        24,
        32,
        4,
        context_length=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        head_size=128,
        num_experts=128,
        experts_per_token=8,
        expert_size=768,
    ),
}
# the same at 4 layers (~2.5B params), for iterating on MoE speed without the 9 GB file; its
# Q4_K_M has Q6_K experts' down in half its layers, as the 24-layer one
SHAPES["moe-4l-a1.5b"] = replace(SHAPES["moe-15b-a1.5b"], num_layers=4)


def tensor_shapes(shape: Shape, vocab_size: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape: rows, columns) of every tensor, in file order; embeddings tied."""
    h, q, kv = (
        shape.hidden_size,
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
    )
    e, inter = shape.num_experts, shape.expert_size
    if e:
        mlp = (
            ("attn_q_norm", (shape.head_dim,)),
            ("attn_k_norm", (shape.head_dim,)),
            ("ffn_gate_inp", (e, h)),
            ("ffn_gate_exps", (e, inter, h)),
            ("ffn_up_exps", (e, inter, h)),
            ("ffn_down_exps", (e, h, inter)),
        )
    else:
        mlp = (
            ("ffn_gate", (shape.intermediate_size, h)),
            ("ffn_up", (shape.intermediate_size, h)),
            ("ffn_down", (h, shape.intermediate_size)),
        )
    yield "token_embd.weight", (vocab_size, h)
    for i in range(shape.num_layers):
        yield from (
            (f"blk.{i}.{name}.weight", dims)
            for name, dims in (
                ("attn_norm", (h,)),
                ("attn_q", (q, h)),
                ("attn_k", (kv, h)),
                ("attn_v", (kv, h)),
                ("attn_output", (h, q)),
                ("ffn_norm", (h,)),
                *mlp,
            )
        )
    yield "output_norm.weight", (h,)


def active_parameters(shape: Shape, vocab_size: int) -> int:
    """Parameters a token reads: all but the experts it does not choose (the tied vocabulary
    counted once)."""
    total = sum(int(np.prod(dims)) for _, dims in tensor_shapes(shape, vocab_size))
    unchosen = shape.num_experts - shape.experts_per_token
    return total - shape.num_layers * unchosen * 3 * shape.expert_size * shape.hidden_size


def _stays_f32(name: str, dims: tuple[int, ...]) -> bool:
    """Norms, and a router (llama-quantize keeps ffn_gate_inp F32 too)."""
    return len(dims) == 1 or name.endswith("ffn_gate_inp.weight")


def copy_tokenizer(writer: GGUFWriter, source: Path) -> int:
    """Copy every `tokenizer.*` key of `source` into `writer`; returns the vocabulary size."""
    reader = GGUFReader(source)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise ValueError(f"{source}: has no tokenizer (tokenizer.ggml.tokens) to copy")
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def write_random_gguf(
    path: Path, shape_name: str, tokenizer_source: Path, dtype: str = "F16", seed: int = 0
) -> None:
    """Write the file tensor by tensor: matrices N(0, WEIGHT_STD) in `dtype`, norms 1 in F32."""
    shape, (np_dtype, file_type) = SHAPES[shape_name], _FLOAT_TYPES[dtype]
    writer = GGUFWriter(path, shape.arch)
    writer.add_name(f"random-{shape.arch}-{shape_name}")
    writer.add_file_type(file_type)
    vocab = copy_tokenizer(writer, tokenizer_source)
    writer.add_vocab_size(vocab)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_block_count(shape.num_layers)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    if shape.num_experts:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
        writer.add_expert_count(shape.num_experts)
        writer.add_expert_used_count(shape.experts_per_token)
        writer.add_expert_feed_forward_length(shape.expert_size)
    tensors = list(tensor_shapes(shape, vocab))
    for name, dims in tensors:
        item = np.dtype(np.float32 if _stays_f32(name, dims) else np_dtype)
        writer.add_tensor_info(name, dims, item, int(np.prod(dims)) * item.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in tensors:
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, np.float32))
        else:
            w = rng.standard_normal(dims, np.float32) * WEIGHT_STD
            writer.write_tensor_data(w if _stays_f32(name, dims) else w.astype(np_dtype))
    writer.close()


def quantize(llama_quantize: Path, source: Path, target: Path, qtype: str) -> None:
    """llama-quantize source -> target; its own message when it fails."""
    proc = subprocess.run(
        [str(llama_quantize), str(source), str(target), qtype], capture_output=True, text=True
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        raise ValueError(f"llama-quantize {qtype} failed (exit {proc.returncode}):\n{tail}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shape",
        choices=list(SHAPES),
        required=True,
        help="tiny (tests), 1b (Llama-3.2-1B dims), 3b (Llama-3.2-3B dims), tiny-moe (tests), "
        "small-moe (the MoE layout at rows of 256, for quality per GGUF type) or "
        "moe-15b-a1.5b (Qwen3-MoE: Qwen3-30B-A3B's widths and 128 experts, 8 active, 24 layers) "
        "or moe-4l-a1.5b (the same at 4 layers)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the float file to write (default random-ARCH-SHAPE.DTYPE.gguf here)",
    )
    p.add_argument(
        "--dtype", choices=list(_FLOAT_TYPES), default="F16", help="matrices' type (default F16)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument(
        "--tokenizer-from",
        default="smollm2-135m",
        help="a GGUF (or model alias) whose tokenizer to copy (default smollm2-135m)",
    )
    p.add_argument(
        "--quantize",
        default=None,
        metavar="TYPE",
        help="also write OUT with .TYPE.gguf (e.g. Q4_K_M) by llama.cpp's llama-quantize",
    )
    p.add_argument(
        "--llama-quantize",
        default=None,
        metavar="PATH",
        help="llama-quantize binary (default: the one on PATH)",
    )


def main(args: argparse.Namespace) -> None:
    from tandem.models.loader.model_files import gguf_source

    source = gguf_source(args.tokenizer_from)
    if source is None:
        raise FileNotFoundError(
            f"--tokenizer-from {args.tokenizer_from!r}: not a model alias or .gguf file"
        )
    tool = (
        llama_cpp_tool("llama-quantize", args.llama_quantize) if args.quantize else None
    )  # refuse before writing
    out = args.out or Path(f"random-{SHAPES[args.shape].arch}-{args.shape}.{args.dtype}.gguf")
    print(
        f"writing {out} ({args.shape}, {args.dtype}, tokenizer of {source.name})...",
        file=sys.stderr,
        flush=True,
    )
    write_random_gguf(out, args.shape, source, args.dtype, args.seed)
    print(out)
    if tool is not None:
        target = out.with_suffix(f".{args.quantize}.gguf")
        print(f"quantizing to {target}...", file=sys.stderr, flush=True)
        quantize(tool, out, target, args.quantize)
        print(target)
