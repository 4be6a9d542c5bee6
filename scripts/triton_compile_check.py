"""Compile the Triton kernels for an H100/H200 (sm_90) on a machine without a GPU: triton's
wheel carries ptxas, so type, shape and resource errors show here, before GPU time is spent.

    PYTHONPATH=$PWD .venv/bin/python scripts/triton_compile_check.py

Prints, per variant (dtype, query heads per KV head, head_dim, decode or mixed), the compile
seconds and the shared memory a program takes (an H200 SM has 228 KiB)."""

from __future__ import annotations

import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tandem.executor import triton_attention as ta

TARGET = GPUTarget("cuda", 90, 32)
# (group, head_dim): SmolLM2-135M, the tests' tiny Llama / Qwen3, a Llama-3-8B-like shape
SHAPES = [(3, 64), (2, 16), (2, 32), (4, 128)]


def attention(
    dtype: str, group: int, head_dim: int, max_query_len: int, block_size: int = 16
) -> tuple[float, int]:
    block_m, block_q, tile = ta._tiles(group, max_query_len, block_size)
    ptr = f"*{dtype}"
    signature = {
        "q_ptr": ptr,
        "k_cache_ptr": ptr,
        "v_cache_ptr": ptr,
        "out_ptr": ptr,
        "block_tables_ptr": "*i64",
        "seq_lens_ptr": "*i64",
        "qsl_ptr": "*i64",
        "scale": "fp32",
        "num_seqs": "i32",
        "block_size": "i32",
    }
    signature |= {f"stride_{s}": "i32" for s in ("qt", "qh", "ot", "oh", "cs", "ch", "bt")}
    constexprs = {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "HEAD_PAD": triton.next_power_of_2(head_dim),
        "TILE": tile,
        "BLOCK_Q": block_q,
        "BLOCK_M": block_m,
        "IEEE": dtype == "fp32",
    }
    signature |= {name: "constexpr" for name in constexprs}
    start = time.perf_counter()
    kernel = triton.compile(
        ASTSource(ta._unified_attention_kernel, signature, constexprs), target=TARGET
    )
    return time.perf_counter() - start, kernel.metadata.shared


def kv_write(dtype: str, row: int) -> None:
    ptr = f"*{dtype}"
    signature = {
        "k_ptr": ptr,
        "v_ptr": ptr,
        "k_cache_ptr": ptr,
        "v_cache_ptr": ptr,
        "slot_ptr": "*i64",
        "stride_kt": "i32",
        "stride_vt": "i32",
        "stride_ct": "i32",
        "ROW": "constexpr",
        "ROW_PAD": "constexpr",
    }
    constexprs = {"ROW": row, "ROW_PAD": triton.next_power_of_2(row)}
    triton.compile(ASTSource(ta._reshape_and_cache_kernel, signature, constexprs), target=TARGET)


if __name__ == "__main__":
    for dtype in ("bf16", "fp32"):
        kv_write(dtype, 3 * 64)
        for group, head_dim in SHAPES:
            for label, max_query_len in (("decode", 1), ("mixed", 300)):
                seconds, smem = attention(dtype, group, head_dim, max_query_len)
                print(
                    f"{dtype} group {group} head_dim {head_dim:3} {label:6}: "
                    f"{seconds:5.1f} s, {smem / 1024:5.1f} KiB shared"
                )
