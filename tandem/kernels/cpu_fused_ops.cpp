// Fused small ops of a decoder layer for CPU: at batch 1 a step is dominated by the fixed cost
// of ~40 tiny PyTorch ops per layer, not by arithmetic. Each op here rounds exactly where the
// PyTorch code it replaces rounds (models/layers.py), so bf16 results are the same bits.
// Serial on purpose: no parallel region of its own, so the process keeps torch's one OpenMP team
// (a second, spinning team made every oneDNN GEMM ~50x slower on 2 cores).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: its C++ frontend headers add ~15 s of parsing (21 s against 5 s, g++ -fsyntax-only, AMD EPYC Zen 3)
#include <cmath>

namespace tandem_cpu_fused_ops {

namespace {

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }

// sum(x^2) in fp32 over kLanes partial sums (lane l: inputs l, l + kLanes, ...), added in a fixed
// order at the end: one serial chain of adds was latency-bound (a 3072-wide row took ~3 us, most
// of add_rms_norm at 16 rows), and the lanes vectorise with no -ffast-math. Any build gives the
// same sum; it differs from torch's order by ulps, as the serial one did.
constexpr int64_t kLanes = 16;

template <typename T>
float sum_squares(const T* x, int64_t h) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= h; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) {
      float v = static_cast<float>(x[i + l]);
      lane[l] += v * v;
    }
  for (; i < h; ++i) {
    float v = static_cast<float>(x[i]);
    lane[i % kLanes] += v * v;
  }
  float ss = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) ss += lane[l];
  return ss;
}

// out = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), the fp32 statistics of transformers.
template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, int64_t h, float eps) {
  float r = 1.f / std::sqrt(sum_squares(x, h) / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) {
    T normed = round_to<T>(static_cast<float>(x[i]) * r);
    out[i] = round_to<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
  }
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous(), "rms_norm: contiguous [T, H]");
  auto out = at::empty_like(x);
  int64_t t = x.size(0), h = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for (int64_t i = 0; i < t; ++i) rms_norm_row(xp + i * h, wp, op + i * h, h, (float)eps);
  });
  return out;
}

// (s, rms_norm(s)) with s = x + residual: the residual add and the next norm in one pass.
std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous(), "add_rms_norm: contiguous [T, H]");
  auto sum = at::empty_like(x);
  auto out = at::empty_like(x);
  int64_t t = x.size(0), h = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for (int64_t i = 0; i < t; ++i) {
      for (int64_t j = 0; j < h; ++j)
        sp[i * h + j] = round_to<scalar_t>(static_cast<float>(rp[i * h + j]) + static_cast<float>(xp[i * h + j]));
      rms_norm_row(sp + i * h, wp, op + i * h, h, (float)eps);
    }
  });
  return {sum, out};
}

// RMSNorm in place over each head_dim slice of the first q_heads (q_weight) and the next
// k_heads (k_weight) heads of each row of qkv [T, row]: QK-norm on the fused projection, so
// RoPE and the decode kernel can take it as it is.
void qk_rms_norm_(at::Tensor qkv, at::Tensor q_weight, at::Tensor k_weight, int64_t q_heads, int64_t k_heads,
                  int64_t head_dim, double eps) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qk_rms_norm_: [T, row] with unit inner stride");
  TORCH_CHECK(q_weight.is_contiguous() && k_weight.is_contiguous() && q_weight.numel() == head_dim &&
              k_weight.numel() == head_dim && q_weight.scalar_type() == qkv.scalar_type() &&
              k_weight.scalar_type() == qkv.scalar_type(), "qk_rms_norm_: [head_dim] weights in qkv's dtype");
  TORCH_CHECK((q_heads + k_heads) * head_dim <= qkv.size(1), "qk_rms_norm_: more heads than the row holds");
  int64_t t = qkv.size(0), row = qkv.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "qk_rms_norm_", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    const scalar_t* qw = q_weight.data_ptr<scalar_t>();
    const scalar_t* kw = k_weight.data_ptr<scalar_t>();
    for (int64_t i = 0; i < t; ++i)
      for (int64_t hd = 0; hd < q_heads + k_heads; ++hd) {
        scalar_t* x = base + i * row + hd * head_dim;
        rms_norm_row(x, hd < q_heads ? qw : kw, x, head_dim, (float)eps);  // reads x whole before writing
      }
  });
}

// Rotate-half RoPE in place on the first `heads` heads of each row of qkv [T, row] (q then k):
// x * cos + rotate_half(x) * sin, cos and sin rounded to the dtype first, each product and the
// sum rounded as PyTorch's elementwise ops round them. cos_sin: [max_pos, head_dim] fp32 (cos | sin).
void rope_(at::Tensor qkv, at::Tensor positions, at::Tensor cos_sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope_: [T, row] with unit inner stride");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous(), "rope_: fp32 cos_sin table");
  int64_t t = qkv.size(0), row = qkv.stride(0), half = head_dim / 2;
  auto pos = positions.to(at::kLong).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    std::vector<float> c(half), s(half);
    for (int64_t i = 0; i < t; ++i) {
      const float* cs = table + pp[i] * head_dim;
      for (int64_t j = 0; j < half; ++j) {
        c[j] = static_cast<float>(round_to<scalar_t>(cs[j]));
        s[j] = static_cast<float>(round_to<scalar_t>(cs[half + j]));
      }
      for (int64_t hd = 0; hd < heads; ++hd) {
        scalar_t* x = base + i * row + hd * head_dim;
        for (int64_t j = 0; j < half; ++j) {
          float a = static_cast<float>(x[j]), bb = static_cast<float>(x[half + j]);
          float lo = static_cast<float>(round_to<scalar_t>(a * c[j])) +
                     static_cast<float>(round_to<scalar_t>(-bb * s[j]));
          float hi = static_cast<float>(round_to<scalar_t>(bb * c[j])) +
                     static_cast<float>(round_to<scalar_t>(a * s[j]));
          x[j] = round_to<scalar_t>(lo);
          x[half + j] = round_to<scalar_t>(hi);
        }
      }
    }
  });
}

}  // namespace

// This kernel's functions, in its submodule of the unit's module (kernels/__init__.py: UNITS).
void bind(pybind11::module_ m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last axis");
  m.def("add_rms_norm", &add_rms_norm, "residual add, then RMSNorm");
  m.def("qk_rms_norm_", &qk_rms_norm_, "RMSNorm in place on each q and k head of a fused qkv");
  m.def("rope_", &rope_, "rotate-half RoPE in place on q and k");
}

}  // namespace tandem_cpu_fused_ops
