// Shared definitions of the wire kernels (csrc/wire.cpp, csrc/cuda/wire.cu).
//
// The wire format and the arithmetic are specified in
// flatgrad/kernels/wire_reference.py ([Note: wire format], [Note: wire
// arithmetic contract]); these helpers must agree with segment_bytes() there.
#pragma once

#include <c10/util/Float8_e4m3fn.h>

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define FLATGRAD_HD __host__ __device__ inline
#else
#define FLATGRAD_HD inline
#endif

namespace flatgrad {
namespace wire {

// Quantized kinds, as passed by flatgrad/kernels/wire.py (_KIND_CODES).
constexpr int64_t kInt8 = 0;
constexpr int64_t kFp8 = 1;

FLATGRAD_HD int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }
FLATGRAD_HD int64_t nblocks(int64_t shard_numel, int64_t block) { return (shard_numel + block - 1) / block; }
// Bytes of one rank's segment: S values padded to 16, then nblocks fp32 scales padded to 16.
FLATGRAD_HD int64_t segment_bytes(int64_t shard_numel, int64_t block) {
  return round16(shard_numel) + round16(4 * nblocks(shard_numel, block));
}
// The fp32 scales are read and written in place, at offsets that are multiples of 16 from the
// wire's start (segment_bytes and round16 above): the wire must start 4-byte aligned.
inline bool scales_aligned(const void* wire) { return reinterpret_cast<uintptr_t>(wire) % 4 == 0; }

FLATGRAD_HD float qmax(int64_t kind) { return kind == kInt8 ? 127.0f : 448.0f; }

// The wire code of y = x / scale in a block whose scale is not 0, and in *dq the code's fp32 value:
// int8 round half to even clamped to [-127, 127]; fp8 e4m3fn of y clamped to [-448, 448] (RNE).
// NaN (a block holding inf or NaN) is int8 0 and fp8 0x7F, NaN's code, as quantize_codes in
// flatgrad/kernels/wire_reference.py; the clamps below would otherwise turn it into the lowest code.
// The CPU (wire_cpu.h) and CUDA (csrc/cuda/wire.cu) quantizes both call this.
FLATGRAD_HD uint8_t quantize_code(float y, int64_t kind, float* dq) {
  if (y != y) {
    const c10::Float8_e4m3fn nan(0x7F, c10::Float8_e4m3fn::from_bits());
    *dq = kind == kInt8 ? 0.0f : static_cast<float>(nan);
    return kind == kInt8 ? uint8_t{0} : uint8_t{0x7F};
  }
  if (kind == kInt8) {
#if defined(__CUDA_ARCH__)
    const float r = rintf(y);  // round half to even
#else
    const float r = std::nearbyint(y);  // round half to even (the default rounding mode)
#endif
    const float c = r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r);
    *dq = c;
    return static_cast<uint8_t>(static_cast<int8_t>(c));
  }
  const c10::Float8_e4m3fn q(y < -448.0f ? -448.0f : (y > 448.0f ? 448.0f : y));
  *dq = static_cast<float>(q);
  return q.x;
}

}  // namespace wire
}  // namespace flatgrad
