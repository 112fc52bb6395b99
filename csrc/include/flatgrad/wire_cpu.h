// The CPU quantize of one block of the wire (csrc/wire.cpp's wire_quantize and
// csrc/pack_quantize.cpp's fused pack-quantize share it).
//
// Arithmetic: [Note: wire arithmetic contract] in docs/design.md,
// bit for bit (the files including this are built with -ffp-contract=off).
#pragma once

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "flatgrad/wire.h"

namespace flatgrad {
namespace wire {

// Quantizes the n <= 4096 fp32 values x[0, n) (+ res[k] when res != nullptr, added into x
// in place) into values[0, n) and the block's fp32 scale into *scale_out; updates res.
inline void quantize_values(float* x, float* res, int64_t n, int64_t kind, uint8_t* values, float* scale_out) {
  float absmax = 0.0f;
  for (int64_t k = 0; k < n; ++k) {
    float v = x[k];
    if (res != nullptr) v = v + res[k];
    x[k] = v;
    const float a = std::fabs(v);
    absmax = (a > absmax || a != a) ? a : absmax;
  }
  const float scale = absmax / qmax(kind);
  std::memcpy(scale_out, &scale, sizeof(float));
  if (scale == 0.0f) {
    std::fill(values, values + n, uint8_t{0});
    if (res != nullptr) std::copy(x, x + n, res);  // x - 0 * 0
    return;
  }
  for (int64_t k = 0; k < n; ++k) {
    float dq;
    values[k] = quantize_code(x[k] / scale, kind, &dq);
    if (res != nullptr) res[k] = x[k] - dq * scale;
  }
}

// quantize_values of the n <= 4096 values float(src[k]).
template <typename src_t>
inline void quantize_block(const src_t* src, float* res, int64_t n, int64_t kind, uint8_t* values, float* scale_out) {
  float x[4096];
  for (int64_t k = 0; k < n; ++k) x[k] = static_cast<float>(src[k]);
  quantize_values(x, res, n, kind, values, scale_out);
}

}  // namespace wire
}  // namespace flatgrad
