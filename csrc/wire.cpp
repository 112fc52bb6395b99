// The wire kernels of the all_to_all reduction modes: schemas and CPU kernels.
//
// wire_sum:            out (=|+=) scale * sum_w float(recv[w])                 (mode "exact")
// wire_quantize:       wire <- blockwise int8/fp8 of packed (+ residual)      (modes "int8", "fp8")
// wire_dequantize_sum: out (=|+=) scale * sum_w float(q_w) * scale_w         (modes "int8", "fp8")
// wire_requantize:     wire_out <- blockwise int8/fp8 of sum_l float(q_l) * scale_l (+ residual)
//                      (between the stages of "qgz_int8", "qgz_fp8"; [Note: requantize])
//
// Both unpacks optionally return the stats [sum_sq, nonfinite_count] (fp32) of
// the values written, computed in the same pass as the regular unpack's
// (csrc/flatgrad.cpp): per fixed chunk of kGrain elements, summed in double over
// fixed lanes, the chunks then added in order, so the result depends on the
// shard's size only, never on the thread count.
//
// Arithmetic and byte layout are the reference's, bit for bit: see
// [Note: wire format] and [Note: wire arithmetic contract] in
// docs/design.md. setup.py passes -ffp-contract=off, so no
// multiply-add is fused; the sums run over ranks 0..W-1 in order.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "flatgrad/wire.h"
#include "flatgrad/wire_checks.h"
#include "flatgrad/wire_cpu.h"

namespace flatgrad {
namespace {

using wire::nblocks;
using wire::round16;
using wire::segment_bytes;

// Elements a task sums at a time: an fp32 accumulator of this size stays in L1.
constexpr int64_t kTile = 1024;
// Elements per unit of parallel work and per stats partial (a multiple of every block size).
constexpr int64_t kGrain = 32768;
static_assert(kGrain % 4096 == 0 && kGrain % kTile == 0, "a chunk must hold whole blocks and tiles");
// Independent accumulator lanes of the stats sums (as in flatgrad.cpp).
constexpr int kLanes = 8;

// float of an fp8 e4m3fn byte, exactly, in branch-free integer operations (c10's conversion
// does not vectorise). Normal: the exponent rebiased (+120) and the 3 mantissa bits moved
// into place; subnormal (e == 0): 2**-6 * (1 + m/8) - 2**-6 = m * 2**-9, exactly; 0x7F / 0xFF:
// NaN with torch's bits (0x7FF00000, signed). The scalar form, for the tails of the AVX2 loop
// and for CPUs without AVX2 + F16C; gcc vectorises it poorly.
inline float fp8_to_float(uint8_t b) {
  const uint32_t x = b;
  const uint32_t sign = (x & 0x80u) << 24;
  const uint32_t normal = ((x & 0x7Fu) << 20) + (120u << 23);
  const uint32_t subnormal = c10::bit_cast<uint32_t>(c10::bit_cast<float>(normal + (1u << 23)) - 0x1p-6f);
  const uint32_t bits = (x & 0x7Fu) < 8 ? subnormal : ((x & 0x7Fu) == 0x7Fu ? 0x7FF00000u : normal);
  return c10::bit_cast<float>(bits | sign);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define FLATGRAD_HAVE_FP8_AVX2 1
// 16 e4m3fn bytes -> 16 floats, exactly, through the hardware fp16 -> fp32 conversion (the
// byte shifted into an fp16 is the value / 256) and one exact multiply, in place of the
// per-byte integer decode above. See [Note: fp8 decode on x86] in docs/design.md.
__attribute__((target("avx2,f16c"))) inline void fp8x16(const uint8_t* q, __m256& lo, __m256& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m256i w = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);  // b << 8
  __m256i h = _mm256_and_si256(_mm256_srai_epi16(w, 1), _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F00)), _mm256_set1_epi16(0x7F00));
  h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7E00)));
  const __m256 k256 = _mm256_set1_ps(256.0f);
  lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k256);
  hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k256);
}

// acc (=|+=) fp8(q) * sc over n elements: the first n - n % 16 with fp8x16, the rest scalar.
// The same fp32 operations in the same order as the scalar loop (no FMA), so the same bits.
__attribute__((target("avx2,f16c"))) void fp8_dequantize_add_avx2(const uint8_t* q, float sc, float* acc,
                                                                     int64_t n, bool first) {
  const __m256 s = _mm256_set1_ps(sc);
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    __m256 lo, hi;
    fp8x16(q + k, lo, hi);
    lo = _mm256_mul_ps(lo, s);
    hi = _mm256_mul_ps(hi, s);
    if (!first) {
      lo = _mm256_add_ps(_mm256_loadu_ps(acc + k), lo);
      hi = _mm256_add_ps(_mm256_loadu_ps(acc + k + 8), hi);
    }
    _mm256_storeu_ps(acc + k, lo);
    _mm256_storeu_ps(acc + k + 8, hi);
  }
  for (; k < n; ++k) {
    const float v = fp8_to_float(q[k]) * sc;
    acc[k] = first ? v : acc[k] + v;
  }
}

bool cpu_has_fp8_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}
#endif

// The dequantize loops, compiled for AVX2 and for the x86-64 baseline (as in flatgrad.cpp);
// no FMA is enabled, so both compute the same bits.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FLATGRAD_WIRE_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FLATGRAD_WIRE_CLONES
#endif

// acc (=|+=) dequantized q * sc over n elements (kind: int8 or fp8).
FLATGRAD_WIRE_CLONES void dequantize_add(const uint8_t* q, float sc, float* acc, int64_t n, int64_t kind, bool first) {
  if (kind == wire::kInt8) {
    const int8_t* qi = reinterpret_cast<const int8_t*>(q);
    if (first) {
      for (int64_t k = 0; k < n; ++k) acc[k] = static_cast<float>(qi[k]) * sc;
    } else {
      for (int64_t k = 0; k < n; ++k) acc[k] = acc[k] + static_cast<float>(qi[k]) * sc;
    }
  } else if (first) {
#ifdef FLATGRAD_HAVE_FP8_AVX2
    if (cpu_has_fp8_avx2()) return fp8_dequantize_add_avx2(q, sc, acc, n, true);
#endif
    for (int64_t k = 0; k < n; ++k) acc[k] = fp8_to_float(q[k]) * sc;
  } else {
#ifdef FLATGRAD_HAVE_FP8_AVX2
    if (cpu_has_fp8_avx2()) return fp8_dequantize_add_avx2(q, sc, acc, n, false);
#endif
    for (int64_t k = 0; k < n; ++k) acc[k] = acc[k] + fp8_to_float(q[k]) * sc;
  }
}

template <typename out_t>
inline void finish_tile(const float* acc, out_t* out, int64_t n, float scale, bool accumulate) {
  for (int64_t k = 0; k < n; ++k) {
    float a = scale != 1.0f ? acc[k] * scale : acc[k];
    out[k] = accumulate ? static_cast<out_t>(static_cast<float>(out[k]) + a) : static_cast<out_t>(a);
  }
}

// Stats of the values written: sum of squares (double) and non-finite count.
struct Partial {
  double sum_sq = 0.0;
  int64_t nonfinite = 0;
};

// Adds the stats of n values as written (read back from out while still in cache), over
// kLanes fixed lanes: the result depends only on n and the values.
template <typename out_t>
FLATGRAD_WIRE_CLONES void add_stats(const out_t* out, int64_t n, Partial& partial) {
  double sum[kLanes] = {};
  int64_t bad[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = static_cast<float>(out[i + j]);
      sum[j] += static_cast<double>(v) * static_cast<double>(v);
      bad[j] += (c10::bit_cast<uint32_t>(v) & 0x7F800000u) == 0x7F800000u;
    }
  }
  for (int j = 0; i < n; ++i, ++j) {
    const float v = static_cast<float>(out[i]);
    sum[j] += static_cast<double>(v) * static_cast<double>(v);
    bad[j] += (c10::bit_cast<uint32_t>(v) & 0x7F800000u) == 0x7F800000u;
  }
  for (int j = 0; j < kLanes; ++j) {
    partial.sum_sq += sum[j];
    partial.nonfinite += bad[j];
  }
}

// Runs body(begin, end, partial) over the fixed chunks of kGrain elements of [0, s) in
// parallel, then returns fp32 [sum_sq, nonfinite_count] of the chunks' partials added in
// chunk order (or an empty tensor without stats). See the top of this file.
template <typename Body>
at::Tensor for_chunks(int64_t s, bool stats, const at::Tensor& like, Body&& body) {
  const int64_t num_chunks = (s + kGrain - 1) / kGrain;
  std::vector<Partial> partials(stats ? num_chunks : 0);
  at::parallel_for(0, num_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    Partial scratch;
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      body(c * kGrain, std::min(s, (c + 1) * kGrain), stats ? partials[c] : scratch);
    }
  });
  at::Tensor result = at::empty({stats ? 2 : 0}, like.options().dtype(at::kFloat));
  if (stats) {
    Partial sum;
    for (const Partial& p : partials) {
      sum.sum_sq += p.sum_sq;
      sum.nonfinite += p.nonfinite;
    }
    result.data_ptr<float>()[0] = static_cast<float>(sum.sum_sq);
    result.data_ptr<float>()[1] = static_cast<float>(sum.nonfinite);
  }
  return result;
}

void check_common(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() == 1, "flatgrad::wire: ", what,
              " must be a contiguous 1-D CPU tensor");
}

at::Tensor wire_sum_cpu(const at::Tensor& recv, int64_t world_size, const at::Tensor& out, double scale,
                        bool accumulate, bool stats) {
  check_common(recv, "recv");
  check_common(out, "out");
  const int64_t s = out.numel();
  TORCH_CHECK(world_size >= 1 && recv.numel() == world_size * s, "flatgrad::wire_sum: recv must hold W * S elements");
  const float fscale = static_cast<float>(scale);
  at::Tensor result;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, recv.scalar_type(), "wire_sum", [&] {
    using src_t = scalar_t;
    const src_t* src = recv.const_data_ptr<src_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "wire_sum_out", [&] {
      using out_t = scalar_t;
      out_t* dst = out.mutable_data_ptr<out_t>();
      result = for_chunks(s, stats, out, [&](int64_t begin, int64_t end, Partial& partial) {
        float acc[kTile];
        for (int64_t t = begin; t < end; t += kTile) {
          const int64_t n = std::min(kTile, end - t);
          for (int64_t k = 0; k < n; ++k) acc[k] = static_cast<float>(src[t + k]);
          for (int64_t w = 1; w < world_size; ++w) {
            const src_t* row = src + w * s + t;
            for (int64_t k = 0; k < n; ++k) acc[k] = acc[k] + static_cast<float>(row[k]);
          }
          finish_tile(acc, dst + t, n, fscale, accumulate);
          if (stats) add_stats(dst + t, n, partial);
        }
      });
    });
  });
  return result;
}

// wire::quantize_block, compiled for AVX2 too (a vector round-to-integer instead of a
// nearbyint call per element; no FMA, so the same bits).
template <typename src_t>
FLATGRAD_WIRE_CLONES void quantize_block(const src_t* src, float* res, int64_t n, int64_t kind, uint8_t* values,
                                         float* scale_out) {
  wire::quantize_block(src, res, n, kind, values, scale_out);
}

void wire_quantize_cpu(const at::Tensor& packed, int64_t world_size, int64_t block, int64_t kind,
                       const at::Tensor& wire_buf, const std::optional<at::Tensor>& residual) {
  check_common(packed, "packed");
  check_common(wire_buf, "wire");
  TORCH_CHECK(wire_buf.scalar_type() == at::kByte, "flatgrad::wire_quantize: wire must be uint8");
  TORCH_CHECK(wire::scales_aligned(wire_buf.const_data_ptr()), "flatgrad::wire_quantize: wire must start at a 4-byte ",
              "aligned address (its fp32 scales are written in place), got ", wire_buf.const_data_ptr());
  TORCH_CHECK(block >= 1 && block <= 4096 && world_size >= 1 && packed.numel() % world_size == 0,
              "flatgrad::wire_quantize: bad block or world_size");
  TORCH_CHECK(kind == wire::kInt8 || kind == wire::kFp8, "flatgrad::wire_quantize: kind must be 0 (int8) or 1 (fp8)");
  const int64_t s = packed.numel() / world_size;
  const int64_t nb = nblocks(s, block), seg = segment_bytes(s, block);
  TORCH_CHECK(wire_buf.numel() >= world_size * seg, "flatgrad::wire_quantize: wire too small");
  float* res = nullptr;
  if (residual.has_value()) {
    check_common(*residual, "residual");
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->numel() == packed.numel(),
                "flatgrad::wire_quantize: residual must be fp32 and as large as packed");
    res = residual->mutable_data_ptr<float>();
  }
  uint8_t* out = wire_buf.mutable_data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, packed.scalar_type(), "wire_quantize", [&] {
    const scalar_t* src = packed.const_data_ptr<scalar_t>();
    at::parallel_for(0, world_size * nb, std::max<int64_t>(1, kGrain / block), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t w = i / nb, j = i % nb;
        const int64_t first = j * block, n = std::min(block, s - first);
        uint8_t* segment = out + w * seg;
        quantize_block(src + w * s + first, res == nullptr ? nullptr : res + w * s + first, n, kind,
                       segment + first, reinterpret_cast<float*>(segment + round16(s)) + j);
      }
    });
  });
}

// wire::quantize_values, compiled for AVX2 too (as quantize_block above).
FLATGRAD_WIRE_CLONES void quantize_values(float* x, float* res, int64_t n, int64_t kind, uint8_t* values,
                                          float* scale_out) {
  wire::quantize_values(x, res, n, kind, values, scale_out);
}

template <typename out_t>
at::Tensor dequantize_sum_typed(const uint8_t* in, int64_t world_size, int64_t s, int64_t block, int64_t kind,
                                out_t* dst, float fscale, bool accumulate, bool stats, const at::Tensor& like) {
  const int64_t seg = segment_bytes(s, block);
  return for_chunks(s, stats, like, [&](int64_t begin, int64_t end, Partial& partial) {
    float acc[4096];
    for (int64_t j = begin / block; j * block < end; ++j) {  // a chunk holds whole blocks
      const int64_t first = j * block, n = std::min(block, s - first);
      for (int64_t w = 0; w < world_size; ++w) {
        const uint8_t* segment = in + w * seg;
        float sc;
        std::memcpy(&sc, segment + round16(s) + 4 * j, sizeof(float));
        dequantize_add(segment + first, sc, acc, n, kind, w == 0);
      }
      finish_tile(acc, dst + first, n, fscale, accumulate);
      if (stats) add_stats(dst + first, n, partial);
    }
  });
}

at::Tensor wire_dequantize_sum_cpu(const at::Tensor& wire_buf, int64_t world_size, int64_t block, int64_t kind,
                                   const at::Tensor& out, double scale, bool accumulate, bool stats) {
  check_common(wire_buf, "wire");
  check_common(out, "out");
  TORCH_CHECK(wire_buf.scalar_type() == at::kByte, "flatgrad::wire_dequantize_sum: wire must be uint8");
  TORCH_CHECK(wire::scales_aligned(wire_buf.const_data_ptr()), "flatgrad::wire_dequantize_sum: wire must start at a ",
              "4-byte aligned address (its fp32 scales are read in place), got ", wire_buf.const_data_ptr());
  TORCH_CHECK(block >= 1 && block <= 4096 && world_size >= 1, "flatgrad::wire_dequantize_sum: bad block or world_size");
  TORCH_CHECK(kind == wire::kInt8 || kind == wire::kFp8, "flatgrad::wire_dequantize_sum: kind must be 0 or 1");
  const int64_t s = out.numel();
  TORCH_CHECK(wire_buf.numel() >= world_size * segment_bytes(s, block), "flatgrad::wire_dequantize_sum: wire too small");
  at::Tensor result;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "wire_dequantize_sum", [&] {
    result = dequantize_sum_typed<scalar_t>(wire_buf.const_data_ptr<uint8_t>(), world_size, s, block, kind,
                                            out.mutable_data_ptr<scalar_t>(), static_cast<float>(scale), accumulate,
                                            stats, out);
  });
  return result;
}

// The fused dequantize + fp32 sum + quantize (see [Note: requantize] in docs/design.md):
// parallel over the output blocks, as wire_quantize. Output block (n, j) covers the elements [e0, e0 + len) of
// the (virtual) fp32 partial of segments * S elements, which may straddle two input blocks (of the input
// segments of segments * S elements): each piece is dequantized with its own input block's scale, the sources
// added in order 0..L-1 into an L1-resident accumulator, which is then quantized as wire_quantize does.
void wire_requantize_cpu(const at::Tensor& wire_in, int64_t sources, int64_t block, int64_t kind,
                         const at::Tensor& wire_out, int64_t segments, int64_t shard_numel,
                         const std::optional<at::Tensor>& residual) {
  constexpr const char* op = "flatgrad::wire_requantize";
  check_common(wire_in, "wire_in");
  check_common(wire_out, "wire_out");
  if (residual.has_value()) check_common(*residual, "residual");
  const auto [s, part, seg_in, seg_out, nb] =
      wire::check_requantize(wire_in, sources, block, kind, wire_out, segments, shard_numel, residual, op);
  float* res = residual.has_value() ? residual->mutable_data_ptr<float>() : nullptr;
  const uint8_t* in = wire_in.const_data_ptr<uint8_t>();
  uint8_t* out = wire_out.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, segments * nb, std::max<int64_t>(1, kGrain / block), [&](int64_t begin, int64_t end) {
    float acc[4096];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / nb, j = i % nb;
      const int64_t first = j * block, len = std::min(block, s - first);
      const int64_t e0 = n * s + first, e1 = e0 + len;
      for (int64_t l = 0; l < sources; ++l) {
        const uint8_t* segment = in + l * seg_in;
        for (int64_t a = e0; a < e1;) {  // at most two pieces: len <= block
          const int64_t jin = a / block, b = std::min(e1, (jin + 1) * block);
          float sc;
          std::memcpy(&sc, segment + round16(part) + 4 * jin, sizeof(float));
          dequantize_add(segment + a, sc, acc + (a - e0), b - a, kind, l == 0);
          a = b;
        }
      }
      uint8_t* segment = out + n * seg_out;
      quantize_values(acc, res == nullptr ? nullptr : res + e0, len, kind, segment + first,
                      reinterpret_cast<float*>(segment + round16(s)) + j);
    }
  });
}

}  // namespace
}  // namespace flatgrad

TORCH_LIBRARY_FRAGMENT(flatgrad, m) {
  // With stats the unpacks return fp32 [sum_sq, nonfinite_count] of out as written, else an empty tensor.
  m.def("wire_sum(Tensor recv, int world_size, Tensor(a!) out, float scale, bool accumulate, bool stats) -> Tensor");
  m.def("wire_quantize(Tensor packed, int world_size, int block, int kind, Tensor(a!) wire, Tensor(b!)? residual) -> ()");
  m.def("wire_dequantize_sum(Tensor wire, int world_size, int block, int kind, Tensor(a!) out, float scale, "
        "bool accumulate, bool stats) -> Tensor");
  m.def("wire_requantize(Tensor wire_in, int sources, int block, int kind, Tensor(a!) wire_out, int segments, "
        "int shard_numel, Tensor(b!)? residual) -> ()");
}

TORCH_LIBRARY_IMPL(flatgrad, CPU, m) {
  m.impl("wire_sum", &flatgrad::wire_sum_cpu);
  m.impl("wire_quantize", &flatgrad::wire_quantize_cpu);
  m.impl("wire_dequantize_sum", &flatgrad::wire_dequantize_sum_cpu);
  m.impl("wire_requantize", &flatgrad::wire_requantize_cpu);
}
