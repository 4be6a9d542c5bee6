"""Paged attention on CUDA in Triton: one launch per layer writes the step's K/V into the cache
(`reshape_and_cache`), one launch per layer attends for the whole flattened batch, prefill
chunks and decodes together (`unified_attention`), reading K/V in place through the block
tables. Under TRITON_INTERPRET=1 both run on CPU tensors (the test suite checks them there
against executor/attention.py).

The attention kernel follows vLLM's triton_unified_attention: a program takes BLOCK_Q query
tokens of one sequence and, for one KV head, the query heads of its group, so BLOCK_M =
BLOCK_Q * group rows share every K/V tile read (GQA without expanding K/V). The program finds
its sequence by a binary search over query_start_loc, so the grid depends only on the number
of tokens and sequences: a CUDA graph can replay it with new metadata. It walks the context
one tile of keys (one KV block or several) at a time with an online softmax in fp32; a query
row sees keys up to its own position (causal within the chunk, all of the prefix before it).

An fp8 (e4m3) cache holds rows of head_dim values and a scale byte per group of them, the CPU int8
rows' layout and scale format (executor/kv_quant.py): the write quantises each (token, KV head)
row, the attention dequantises each tile it loads.
"""

from __future__ import annotations

import functools

import torch

from tandem.executor.kv_quant import SCALE_BIAS_BITS, scale_group

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path never needs it
    triton = tl = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _reshape_and_cache_kernel(
        k_ptr,
        v_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        stride_kt,
        stride_vt,
        stride_ct,
        ROW: tl.constexpr,
        ROW_PAD: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t)
        if slot >= 0:  # -1: a padding token of a CUDA-graph batch
            offs = tl.arange(0, ROW_PAD)
            mask = offs < ROW
            k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
            v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
            tl.store(k_cache_ptr + slot * stride_ct + offs, k, mask=mask)
            tl.store(v_cache_ptr + slot * stride_ct + offs, v, mask=mask)

    @triton.jit
    def _reshape_and_cache_fp8_kernel(
        x_ptr,
        cache_ptr,
        slot_ptr,
        stride_xt,
        stride_xh,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        SCALE_GROUP: tl.constexpr,
        GROUPS_PAD: tl.constexpr,
        SCALE_BIAS: tl.constexpr,
    ):
        """Token t's row of KV head h (K or V) as an fp8 row and its scale bytes (kv_quant.py:
        quantize_kv_rows)."""
        t, h = tl.program_id(0), tl.program_id(1)
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            d = tl.arange(0, HEAD_PAD)
            x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d, mask=d < HEAD_DIM, other=0.0)
            x = x.to(tl.float32)
            c = tl.arange(0, GROUPS_PAD)
            in_group = (d[None, :] // SCALE_GROUP) == c[:, None]  # [groups, d]
            amax = tl.max(tl.where(in_group, tl.abs(x)[None, :], 0.0), 1)
            bits = (amax * (1.0 / 448.0)).to(tl.int32, bitcast=True)
            code = tl.minimum(tl.maximum(((bits + 0xFFFFF) >> 20) - (SCALE_BIAS >> 20), 0), 255)
            scale = ((code << 20) + SCALE_BIAS).to(tl.float32, bitcast=True)
            inv = tl.sum(tl.where(in_group, (1.0 / scale)[:, None], 0.0), 0)  # [d]
            row = (slot * tl.num_programs(1) + h) * (HEAD_DIM + tl.cdiv(HEAD_DIM, SCALE_GROUP))
            q = tl.clamp(x * inv, -448.0, 448.0).to(tl.float8e4nv)
            tl.store(cache_ptr + row + d, q, mask=d < HEAD_DIM)
            codes_ptr = cache_ptr.to(tl.pointer_type(tl.uint8)) + row + HEAD_DIM
            tl.store(codes_ptr + c, code.to(tl.uint8), mask=c * SCALE_GROUP < HEAD_DIM)

    @triton.jit
    def _find_seq(qsl_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
        """Sequence s owns q blocks [qsl[s] // BLOCK_Q + s, ...): the last s whose first block
        <= q_block."""
        lo, hi = 0, num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= q_block:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @triton.jit
    def _load_kv_tile(
        k_cache_ptr,
        v_cache_ptr,
        block_table_ptr,
        k_pos,
        k_ok,
        block_size,
        head_off,
        stride_cs,
        d,
        d_ok,
        HEAD_DIM: tl.constexpr,
        FP8: tl.constexpr,
        SCALE_GROUP: tl.constexpr,
        SCALE_BIAS: tl.constexpr,
    ):
        """K and V of the positions k_pos (masked by k_ok) of one sequence, one KV head, through
        its block table; from an fp8 cache, dequantised to fp32."""
        block = tl.load(block_table_ptr + k_pos // block_size, mask=k_ok, other=0)
        slot = block * block_size + k_pos % block_size
        kv_off = slot[:, None] * stride_cs + head_off + d[None, :]
        kv_ok = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_ok, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_ok, other=0.0)
        if FP8:  # each value's group's scale byte, after the row's values
            code_off = kv_off - d[None, :] + HEAD_DIM + d[None, :] // SCALE_GROUP
            u8 = tl.pointer_type(tl.uint8)
            kc = tl.load(k_cache_ptr.to(u8) + code_off, mask=kv_ok, other=0).to(tl.int32)
            vc = tl.load(v_cache_ptr.to(u8) + code_off, mask=kv_ok, other=0).to(tl.int32)
            k = k.to(tl.float32) * ((kc << 20) + SCALE_BIAS).to(tl.float32, bitcast=True)
            v = v.to(tl.float32) * ((vc << 20) + SCALE_BIAS).to(tl.float32, bitcast=True)
        return k, v

    @triton.jit
    def _online_softmax_step(s, v, m, denom, acc, IEEE: tl.constexpr):
        """Fold one tile's scores and values into the rows' running max, denominator and output."""
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet (padding)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        denom = denom * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, denom, acc

    # num_seqs, block_size and window are plain arguments, not specialised: one compiled kernel
    # serves every batch (1 included), block size and layer of a model. window > 0: a
    # sliding-window layer, where a query sees only its last `window` positions.
    @triton.jit(do_not_specialize=["num_seqs", "block_size", "window"])
    def _unified_attention_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        out_ptr,
        block_tables_ptr,
        seq_lens_ptr,
        qsl_ptr,
        scale,
        num_seqs,
        block_size,
        window,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_cs,
        stride_ch,
        stride_bt,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        TILE: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
        IEEE: tl.constexpr,
        FP8: tl.constexpr,
        SCALE_GROUP: tl.constexpr,
        SCALE_BIAS: tl.constexpr,
    ):
        q_block = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = _find_seq(qsl_ptr, num_seqs, q_block, BLOCK_Q)
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        first = (
            q_block - (q_start // BLOCK_Q + seq)
        ) * BLOCK_Q  # first query token of this program
        if first < q_len:
            seq_len = tl.load(seq_lens_ptr + seq)
            context = seq_len - q_len
            rows = tl.arange(0, BLOCK_M)
            tok = first + rows // GROUP
            head = kv_head * GROUP + rows % GROUP
            row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
            d = tl.arange(0, HEAD_PAD)
            d_ok = d < HEAD_DIM
            q = tl.load(
                q_ptr
                + (q_start + tok)[:, None] * stride_qt
                + head[:, None] * stride_qh
                + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            q_pos = context + tok  # each row's position in the sequence
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            denom = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
            # Keys this program can see: up to its last query token's position.
            kv_end = tl.minimum(seq_len, context + first + BLOCK_Q)
            # ... and, in a sliding-window layer, from its first query token's window on.
            kv_start = tl.where(window > 0, tl.maximum(context + first - window + 1, 0), 0)
            offs = tl.arange(0, TILE)
            for j in range(kv_start // TILE, tl.cdiv(kv_end, TILE)):
                # A tile is one KV block, or several when blocks are smaller than a tl.dot tile.
                k_pos = j * TILE + offs
                k_ok = k_pos < kv_end
                k, v = _load_kv_tile(
                    k_cache_ptr,
                    v_cache_ptr,
                    block_tables_ptr + seq * stride_bt,
                    k_pos,
                    k_ok,
                    block_size,
                    kv_head * stride_ch,
                    stride_cs,
                    d,
                    d_ok,
                    HEAD_DIM,
                    FP8,
                    SCALE_GROUP,
                    SCALE_BIAS,
                )
                if FP8:  # the tiles in the activations' dtype, as the dots below take them
                    k, v = k.to(q.dtype), v.to(q.dtype)
                if IEEE:
                    s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = s * scale
                seen = (k_pos[None, :] <= q_pos[:, None]) & (
                    (window <= 0) | (k_pos[None, :] > q_pos[:, None] - window)
                )
                s = tl.where(seen, s, float("-inf"))
                m, denom, acc = _online_softmax_step(s, v, m, denom, acc, IEEE)
            acc = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
            tl.store(
                out_ptr
                + (q_start + tok)[:, None] * stride_ot
                + head[:, None] * stride_oh
                + d[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & d_ok[None, :],
            )


def reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, Hkv, D]; kv_cache: [2, num_slots, Hkv, D] (fp8: kv_quant.row_len). Token t goes
    to slot slot_mapping[t] (skipped where it is -1). One launch for K and V of every token of the
    layer (fp8: one each)."""
    if kv_cache.dtype == torch.float8_e4m3fn:
        head_dim = k.shape[2]
        group = scale_group(head_dim)
        for x, cache in zip((k, v), kv_cache):
            _reshape_and_cache_fp8_kernel[x.shape[:2]](
                x,
                cache,
                slot_mapping,
                x.stride(0),
                x.stride(1),
                HEAD_DIM=head_dim,
                HEAD_PAD=triton.next_power_of_2(head_dim),
                SCALE_GROUP=group,
                GROUPS_PAD=triton.next_power_of_2(-(-head_dim // group)),
                SCALE_BIAS=SCALE_BIAS_BITS,
            )
        return
    k, v = k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
    row = k.shape[1]
    _reshape_and_cache_kernel[(k.shape[0],)](
        k,
        v,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        k.stride(0),
        v.stride(0),
        kv_cache.stride(1),
        ROW=row,
        ROW_PAD=triton.next_power_of_2(row),
    )


@functools.cache
def _tiles(group: int, max_query_len: int, block_size: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, TILE). Decode-only steps: 16 query rows (the smallest tl.dot tile) and
    64 keys per iteration (fewer serial iterations per program: latency). Once a prefill chunk is
    in the batch, 64 rows, so a chunk's queries share each K/V tile read, over 32 keys."""
    decode = max_query_len == 1
    block_m = max(16 if decode else 64, triton.next_power_of_2(group))
    return block_m, block_m // group, max(block_size, 64 if decode else 32)


def unified_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    block_size: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """q: [T, Hq, D] (the batch's query tokens, sequence after sequence); returns [T, Hq, D].
    seq_lens are context lengths after this step; query_start_loc is [num_seqs + 1]; window > 0:
    each query sees only its last `window` positions (a sliding-window layer)."""
    num_tokens, num_heads, head_dim = q.shape
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    block_m, block_q, tile = _tiles(group, max_query_len, block_size)
    out = torch.empty_like(q)
    # An upper bound on the q blocks over all sequences; programs past the last one exit.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _unified_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        num_seqs,
        block_size,
        window,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
        TILE=tile,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        # fp32 products in fp32 (not TF32); the interpreter (CPU tensors) mis-multiplies bf16 dots.
        IEEE=q.dtype == torch.float32 or q.device.type == "cpu",
        FP8=kv_cache.dtype == torch.float8_e4m3fn,
        SCALE_GROUP=scale_group(head_dim),
        SCALE_BIAS=SCALE_BIAS_BITS,
    )
    return out
