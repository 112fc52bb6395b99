// The deterministic stats reduction shared by the CUDA unpacks (csrc/cuda/pack_unpack.cu,
// csrc/cuda/wire.cu): every block writes the double partials [sum_sq, nonfinite] of the
// values it wrote, then stats_finish_kernel adds them in a fixed order. No float atomics.
#pragma once

#include <cstdint>

namespace flatgrad {
namespace cuda {
namespace {

// Threads of every block that calls block_sum2, and of stats_finish_kernel's one block.
constexpr int kStatsThreads = 256;
constexpr int kStatsWarps = kStatsThreads / 32;

// Sums two values over the block; the result is valid in thread 0. The order
// of additions is fixed by the thread layout, so the result is deterministic.
__device__ __forceinline__ void block_sum2(double& a, double& b) {
  __shared__ double partial[2][kStatsWarps];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    a += __shfl_down_sync(0xffffffffu, a, offset);
    b += __shfl_down_sync(0xffffffffu, b, offset);
  }
  if (lane == 0) {
    partial[0][warp] = a;
    partial[1][warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    a = lane < kStatsWarps ? partial[0][lane] : 0.0;
    b = lane < kStatsWarps ? partial[1][lane] : 0.0;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      a += __shfl_down_sync(0xffffffffu, a, offset);
      b += __shfl_down_sync(0xffffffffu, b, offset);
    }
  }
}

// result = [sum of partials[:, 0], sum of partials[:, 1]] as fp32, by one block of
// kStatsThreads in a fixed order (deterministic for a given number of partials).
__global__ void __launch_bounds__(kStatsThreads)
    stats_finish_kernel(const double* __restrict__ partials, int64_t count, float* __restrict__ result) {
  double sum_sq = 0.0;
  double nonfinite = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kStatsThreads) {
    sum_sq += partials[2 * i];
    nonfinite += partials[2 * i + 1];
  }
  block_sum2(sum_sq, nonfinite);
  if (threadIdx.x == 0) {
    result[0] = static_cast<float>(sum_sq);
    result[1] = static_cast<float>(nonfinite);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace flatgrad
