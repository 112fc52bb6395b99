// Shared definitions of the wire kernels (csrc/wire.cpp, csrc/cuda/wire.cu).
//
// The wire format and the arithmetic are specified in
// flatgrad/kernels/wire_reference.py ([Note: wire format], [Note: wire
// arithmetic contract]); these helpers must agree with segment_bytes() there.
#pragma once

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
FLATGRAD_HD float qmax(int64_t kind) { return kind == kInt8 ? 127.0f : 448.0f; }

}  // namespace wire
}  // namespace flatgrad
