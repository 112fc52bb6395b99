// CUDA kernels of the wire ops (schemas and CPU kernels: csrc/wire.cpp).
//
// Arithmetic and byte layout are the reference's, bit for bit (see
// [Note: wire format] and [Note: wire arithmetic contract] in
// docs/design.md): every fp32 operation is an explicit
// round-to-nearest intrinsic (__fadd_rn, __fmul_rn, __fdiv_rn), which nvcc
// never contracts into an FMA; the sums run over ranks 0..W-1 in order.
// Kernels launch on the current stream, and nothing syncs the host.
//
// With stats, every block writes the double partials of the values it wrote and
// stats_finish_kernel (flatgrad/cuda_stats.cuh, shared with the regular unpack)
// adds them in a fixed order: deterministic for a given shard size.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "flatgrad/cuda_stats.cuh"
#include "flatgrad/runs.h"
#include "flatgrad/wire.h"
#include "flatgrad/wire_checks.h"

namespace flatgrad {
namespace cuda {
namespace {

using wire::nblocks;
using wire::round16;
using wire::segment_bytes;

constexpr int kThreads = 256;
static_assert(kThreads == kStatsThreads, "the stats reduction (flatgrad/cuda_stats.cuh) assumes 256 threads");

// Writes out[i] and returns the value written, as fp32 (for the stats).
template <typename out_t>
__device__ __forceinline__ float finish(float acc, out_t* out, int64_t i, float scale, bool accumulate) {
  if (scale != 1.0f) acc = __fmul_rn(acc, scale);
  if (accumulate) acc = __fadd_rn(static_cast<float>(out[i]), acc);
  const out_t written = static_cast<out_t>(acc);
  out[i] = written;
  return static_cast<float>(written);
}

// Per thread: the sum of squares (double) and the non-finite count of the values it wrote.
struct ThreadStats {
  double sum_sq = 0.0;
  double nonfinite = 0.0;
  __device__ __forceinline__ void add(float v) {
    sum_sq += static_cast<double>(v) * static_cast<double>(v);
    nonfinite += (__float_as_uint(v) & 0x7F800000u) == 0x7F800000u ? 1.0 : 0.0;
  }
  // The block's partials to partials[blockIdx.x] (every thread of the block must call it).
  __device__ __forceinline__ void store(double* __restrict__ partials) {
    block_sum2(sum_sq, nonfinite);
    if (threadIdx.x == 0) {
      partials[2 * blockIdx.x] = sum_sq;
      partials[2 * blockIdx.x + 1] = nonfinite;
    }
  }
};

template <typename src_t, typename out_t, bool kStats>
__global__ void __launch_bounds__(kThreads) sum_kernel(const src_t* __restrict__ src, out_t* __restrict__ out, int64_t s,
                                                       int64_t world_size, float scale, bool accumulate,
                                                       double* __restrict__ partials) {
  ThreadStats stats;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < s; i += int64_t(gridDim.x) * blockDim.x) {
    float acc = static_cast<float>(src[i]);
    for (int64_t w = 1; w < world_size; ++w) acc = __fadd_rn(acc, static_cast<float>(src[w * s + i]));
    const float written = finish(acc, out, i, scale, accumulate);
    if constexpr (kStats) stats.add(written);
  }
  if constexpr (kStats) stats.store(partials);
}

__device__ __forceinline__ float nan_max(float m, float a) { return (a > m || a != a) ? a : m; }

// Quantizes one block of n elements, x(k) its fp32 values before the residual, with the
// whole CUDA block (every thread must call it): values[0, n), the fp32 scale to *scale_out,
// and r[0, n) updated when r != nullptr. `partial` is kThreads floats of shared memory.
template <typename Load>
__device__ __forceinline__ void quantize_block(Load x, int64_t n, float* __restrict__ r, int64_t kind,
                                               uint8_t* __restrict__ values, float* __restrict__ scale_out,
                                               float* partial) {
  float m = 0.0f;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    float v = x(k);
    if (r != nullptr) v = __fadd_rn(v, r[k]);
    m = nan_max(m, fabsf(v));
  }
  partial[threadIdx.x] = m;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] = nan_max(partial[threadIdx.x], partial[threadIdx.x + stride]);
    __syncthreads();
  }
  const float scale = __fdiv_rn(partial[0], wire::qmax(kind));
  if (threadIdx.x == 0) *scale_out = scale;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    float v = x(k);
    if (r != nullptr) v = __fadd_rn(v, r[k]);
    float dq = 0.0f;
    uint8_t code = 0;
    if (scale != 0.0f) code = wire::quantize_code(__fdiv_rn(v, scale), kind, &dq);
    values[k] = code;
    if (r != nullptr) r[k] = __fsub_rn(v, __fmul_rn(dq, scale));
  }
}

// One CUDA block quantizes one (destination w, block j) of the wire.
template <typename src_t>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const src_t* __restrict__ src, float* __restrict__ res,
                                                            uint8_t* __restrict__ wire_buf, int64_t s, int64_t block,
                                                            int64_t nb, int64_t seg, int64_t kind) {
  __shared__ float partial[kThreads];
  const int64_t w = blockIdx.x / nb, j = blockIdx.x % nb;
  const int64_t first = j * block, n = min(block, s - first);
  const src_t* x_in = src + w * s + first;
  uint8_t* segment = wire_buf + w * seg;
  quantize_block([x_in](int64_t k) { return static_cast<float>(x_in[k]); }, n,
                 res == nullptr ? nullptr : res + w * s + first, kind, segment + first,
                 reinterpret_cast<float*>(segment + round16(s)) + j, partial);
}

// fp32 of element `at` of a tensor whose table dtype code is `code`.
__device__ __forceinline__ float load_code(int64_t address, int64_t code, int64_t at) {
  switch (code) {
    case kCodeBFloat16:
      return static_cast<float>(reinterpret_cast<const c10::BFloat16*>(address)[at]);
    case kCodeHalf:
      return static_cast<float>(reinterpret_cast<const c10::Half*>(address)[at]);
    default:
      return reinterpret_cast<const float*>(address)[at];
  }
}

// The fused pack-quantize (see [Note: pack-quantize] in docs/design.md):
// one CUDA block per (destination w, block j). The block's elements [p0, p1) of the
// (virtual) packed buffer are gathered along the pack run table into shared memory, as
// fp32 times scale (padding and missing tensors: 0); thread 0 finds the first run by
// binary search, then every thread walks the same runs. The quantize then reads shared
// memory. The tensor table holds (address, dtype code) rows (table_col in flatgrad/runs.h).
__global__ void __launch_bounds__(kThreads)
    pack_quantize_kernel(const int64_t* __restrict__ runs, int64_t num_runs, const int64_t* __restrict__ table,
                         float* __restrict__ res, uint8_t* __restrict__ wire_buf, int64_t s, int64_t block, int64_t nb,
                         int64_t seg, int64_t kind, float scale, bool scaled) {
  __shared__ float xs[4096];
  __shared__ float partial[kThreads];
  __shared__ int64_t first_run;
  const int64_t w = blockIdx.x / nb, j = blockIdx.x % nb;
  const int64_t first = j * block, n = min(block, s - first);
  const int64_t p0 = w * s + first, p1 = p0 + n;
  if (threadIdx.x == 0) {  // the last run with dst_offset <= p0 (the runs tile the buffer in order)
    int64_t lo = 0, hi = num_runs;
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (__ldg(runs + mid * pack_col::kWidth + pack_col::kDstOffset) <= p0) lo = mid; else hi = mid;
    }
    first_run = lo;
  }
  __syncthreads();
  for (int64_t k = first_run; k < num_runs; ++k) {
    const int64_t* row = runs + k * pack_col::kWidth;
    const int64_t dst = __ldg(row + pack_col::kDstOffset);
    if (dst >= p1) break;
    const int64_t length = __ldg(row + pack_col::kLength), valid = __ldg(row + pack_col::kValid);
    const int64_t index = __ldg(row + pack_col::kTensorIndex), src_offset = __ldg(row + pack_col::kSrcOffset);
    const int64_t address = valid > 0 ? __ldg(table + index * table_col::kWidth + table_col::kAddress) : 0;
    const int64_t code = valid > 0 ? __ldg(table + index * table_col::kWidth + table_col::kCode) : kCodeNone;
    const int64_t copied_end = dst + (address != 0 ? valid : 0);
    const int64_t end = min(dst + length, p1);
    for (int64_t pos = max(dst, p0) + threadIdx.x; pos < end; pos += blockDim.x) {
      float v = 0.0f;
      if (pos < copied_end) {
        v = load_code(address, code, src_offset + (pos - dst));
        if (scaled) v = __fmul_rn(v, scale);
      }
      xs[pos - p0] = v;
    }
  }
  __syncthreads();
  uint8_t* segment = wire_buf + w * seg;
  const float* x = xs;
  quantize_block([x](int64_t k) { return x[k]; }, n, res == nullptr ? nullptr : res + p0, kind, segment + first,
                 reinterpret_cast<float*>(segment + round16(s)) + j, partial);
}

// fp32 of the wire code b: int8, or fp8 e4m3fn bits (exact; 0x7F / 0xFF are NaN).
__device__ __forceinline__ float dequantize_code(uint8_t b, int64_t kind) {
  return kind == wire::kInt8 ? static_cast<float>(static_cast<int8_t>(b))
                             : static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits()));
}

// One CUDA block dequantizes and sums one quantization block of the W segments.
template <typename out_t, bool kStats>
__global__ void __launch_bounds__(kThreads)
    dequantize_sum_kernel(const uint8_t* __restrict__ wire_buf, out_t* __restrict__ out, int64_t s, int64_t block,
                          int64_t seg, int64_t world_size, int64_t kind, float scale, bool accumulate,
                          double* __restrict__ partials) {
  const int64_t j = blockIdx.x, first = j * block, n = min(block, s - first);
  ThreadStats stats;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    float acc = 0.0f;
    for (int64_t w = 0; w < world_size; ++w) {
      const uint8_t* segment = wire_buf + w * seg;
      const float sc = reinterpret_cast<const float*>(segment + round16(s))[j];
      const float v = __fmul_rn(dequantize_code(segment[first + k], kind), sc);
      acc = w == 0 ? v : __fadd_rn(acc, v);
    }
    const float written = finish(acc, out, first + k, scale, accumulate);
    if constexpr (kStats) stats.add(written);
  }
  if constexpr (kStats) stats.store(partials);
}

// The fused dequantize + fp32 sum + quantize (see [Note: requantize] in docs/design.md):
// one CUDA block per output (segment n, block j), covering the elements [e0, e0 + n) of the (virtual) fp32
// partial of segments * S elements. Each element is summed over the L sources in order, each with the scale of
// its own input block (an output block may straddle two), into shared memory; the quantize then reads it, as
// pack_quantize_kernel's does.
__global__ void __launch_bounds__(kThreads)
    requantize_kernel(const uint8_t* __restrict__ wire_in, float* __restrict__ res, uint8_t* __restrict__ wire_out,
                      int64_t s, int64_t block, int64_t nb, int64_t part, int64_t seg_in, int64_t seg_out,
                      int64_t sources, int64_t kind) {
  __shared__ float xs[4096];
  __shared__ float partial[kThreads];
  const int64_t w = blockIdx.x / nb, j = blockIdx.x % nb;
  const int64_t first = j * block, n = min(block, s - first);
  const int64_t e0 = w * s + first;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    const int64_t e = e0 + k, scale_at = round16(part) + 4 * (e / block);
    float acc = 0.0f;
    for (int64_t l = 0; l < sources; ++l) {
      const uint8_t* segment = wire_in + l * seg_in;
      const float sc = *reinterpret_cast<const float*>(segment + scale_at);
      const float v = __fmul_rn(dequantize_code(segment[e], kind), sc);
      acc = l == 0 ? v : __fadd_rn(acc, v);
    }
    xs[k] = acc;
  }
  __syncthreads();
  uint8_t* segment = wire_out + w * seg_out;
  const float* x = xs;
  quantize_block([x](int64_t k) { return x[k]; }, n, res == nullptr ? nullptr : res + e0, kind, segment + first,
                 reinterpret_cast<float*>(segment + round16(s)) + j, partial);
}

// The stats of `blocks` partials (or an empty tensor): the partials' buffer and the result.
struct StatsBuffers {
  at::Tensor partials;
  at::Tensor result;
  double* ptr() const { return partials.defined() ? partials.data_ptr<double>() : nullptr; }
};

StatsBuffers stats_buffers(bool stats, int64_t blocks, const at::Tensor& like) {
  const auto f32 = like.options().dtype(at::kFloat);
  if (!stats) return {at::Tensor(), at::empty({0}, f32)};
  if (blocks == 0) return {at::Tensor(), at::zeros({2}, f32)};
  return {at::empty({blocks, 2}, like.options().dtype(at::kDouble)), at::empty({2}, f32)};
}

void finish_stats(const StatsBuffers& b, int64_t blocks, cudaStream_t stream) {
  if (!b.partials.defined()) return;
  stats_finish_kernel<<<1, kStatsThreads, 0, stream>>>(b.ptr(), blocks, b.result.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_cuda(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.dim() == 1, "flatgrad::wire: ", what,
              " must be a contiguous 1-D CUDA tensor");
}

int grid_for(int64_t n) { return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 65535))); }

at::Tensor wire_sum_cuda(const at::Tensor& recv, int64_t world_size, const at::Tensor& out, double scale,
                         bool accumulate, bool stats) {
  check_cuda(recv, "recv");
  check_cuda(out, "out");
  TORCH_CHECK(recv.device() == out.device(), "flatgrad::wire_sum: recv is on ", recv.device(), ", out on ",
              out.device(), "; both must be on one device");
  const int64_t s = out.numel();
  TORCH_CHECK(world_size >= 1 && recv.numel() == world_size * s, "flatgrad::wire_sum: recv must hold W * S elements");
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t blocks = s == 0 ? 0 : grid_for(s);
  const StatsBuffers buffers = stats_buffers(stats, blocks, out);
  if (s == 0) return buffers.result;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, recv.scalar_type(), "wire_sum", [&] {
    using src_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "wire_sum_out", [&] {
      if (stats) {
        sum_kernel<src_t, scalar_t, true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
            recv.const_data_ptr<src_t>(), out.mutable_data_ptr<scalar_t>(), s, world_size, static_cast<float>(scale),
            accumulate, buffers.ptr());
      } else {
        sum_kernel<src_t, scalar_t, false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
            recv.const_data_ptr<src_t>(), out.mutable_data_ptr<scalar_t>(), s, world_size, static_cast<float>(scale),
            accumulate, nullptr);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  finish_stats(buffers, blocks, stream);
  return buffers.result;
}

void wire_quantize_cuda(const at::Tensor& packed, int64_t world_size, int64_t block, int64_t kind,
                        const at::Tensor& wire_buf, const std::optional<at::Tensor>& residual) {
  check_cuda(packed, "packed");
  check_cuda(wire_buf, "wire");
  TORCH_CHECK(wire_buf.scalar_type() == at::kByte, "flatgrad::wire_quantize: wire must be uint8");
  TORCH_CHECK(wire_buf.device() == packed.device(), "flatgrad::wire_quantize: wire is on ", wire_buf.device(),
              ", packed on ", packed.device(), "; both must be on one device");
  TORCH_CHECK(wire::scales_aligned(wire_buf.const_data_ptr()), "flatgrad::wire_quantize: wire must start at a 4-byte ",
              "aligned address (its fp32 scales are written in place), got ", wire_buf.const_data_ptr());
  TORCH_CHECK(block >= 1 && block <= 4096 && world_size >= 1 && packed.numel() % world_size == 0,
              "flatgrad::wire_quantize: bad block or world_size");
  TORCH_CHECK(kind == wire::kInt8 || kind == wire::kFp8, "flatgrad::wire_quantize: kind must be 0 (int8) or 1 (fp8)");
  const int64_t s = packed.numel() / world_size, nb = nblocks(s, block), seg = segment_bytes(s, block);
  TORCH_CHECK(wire_buf.numel() >= world_size * seg, "flatgrad::wire_quantize: wire too small");
  float* res = nullptr;
  if (residual.has_value()) {
    check_cuda(*residual, "residual");
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->numel() == packed.numel(),
                "flatgrad::wire_quantize: residual must be fp32 and as large as packed");
    TORCH_CHECK(residual->device() == packed.device(), "flatgrad::wire_quantize: residual is on ", residual->device(),
                ", packed on ", packed.device(), "; both must be on one device");
    res = residual->mutable_data_ptr<float>();
  }
  if (s == 0) return;
  TORCH_CHECK(world_size * nb <= INT32_MAX, "flatgrad::wire_quantize: too many blocks");
  const c10::cuda::CUDAGuard guard(packed.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, packed.scalar_type(), "wire_quantize", [&] {
    quantize_kernel<scalar_t><<<static_cast<unsigned>(world_size * nb), kThreads, 0, stream>>>(
        packed.const_data_ptr<scalar_t>(), res, wire_buf.mutable_data_ptr<uint8_t>(), s, block, nb, seg, kind);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void pack_quantize_table_cuda(const at::Tensor& table, const at::Tensor& runs, int64_t numel, int64_t world_size,
                              int64_t block, int64_t kind, double scale, const at::Tensor& wire_buf,
                              const std::optional<at::Tensor>& residual) {
  constexpr const char* op = "flatgrad::_pack_quantize_table";
  check_cuda(wire_buf, "wire");
  const at::Device device = wire_buf.device();
  TORCH_CHECK(wire_buf.scalar_type() == at::kByte, op, ": wire must be uint8");
  TORCH_CHECK(wire::scales_aligned(wire_buf.const_data_ptr()), op, ": wire must start at a 4-byte aligned address ",
              "(its fp32 scales are written in place), got ", wire_buf.const_data_ptr());
  TORCH_CHECK(table.device() == device && table.scalar_type() == at::kLong && table.dim() == 2 &&
                  table.size(1) == table_col::kWidth && table.is_contiguous(),
              op, ": table must be a contiguous int64 tensor of shape [T, ", table_col::kWidth, "] on ", device);
  TORCH_CHECK(runs.device() == device && runs.scalar_type() == at::kLong && runs.dim() == 2 &&
                  runs.size(1) == pack_col::kWidth && runs.is_contiguous(),
              op, ": runs must be a contiguous int64 tensor of shape [R, ", pack_col::kWidth, "] on ", device);
  TORCH_CHECK(block >= 1 && block <= 4096, op, ": block must be in [1, 4096], got ", block);
  TORCH_CHECK(kind == wire::kInt8 || kind == wire::kFp8, op, ": kind must be 0 (int8) or 1 (fp8), got ", kind);
  TORCH_CHECK(world_size >= 1 && numel >= 0 && numel % world_size == 0, op, ": numel ", numel,
              " is not a multiple of world_size ", world_size);
  const int64_t s = numel / world_size, nb = nblocks(s, block), seg = segment_bytes(s, block);
  TORCH_CHECK(wire_buf.numel() >= world_size * seg, op, ": wire has ", wire_buf.numel(), " bytes, needs ",
              world_size * seg);
  float* res = nullptr;
  if (residual.has_value()) {
    check_cuda(*residual, "residual");
    TORCH_CHECK(residual->device() == device && residual->scalar_type() == at::kFloat && residual->numel() == numel,
                op, ": residual must be fp32 with numel (", numel, ") elements on ", device);
    res = residual->mutable_data_ptr<float>();
  }
  if (s == 0 || runs.size(0) == 0) return;
  TORCH_CHECK(world_size * nb <= INT32_MAX, op, ": too many blocks");
  const c10::cuda::CUDAGuard guard(device);
  auto stream = c10::cuda::getCurrentCUDAStream();
  pack_quantize_kernel<<<static_cast<unsigned>(world_size * nb), kThreads, 0, stream>>>(
      runs.const_data_ptr<int64_t>(), runs.size(0), table.const_data_ptr<int64_t>(), res,
      wire_buf.mutable_data_ptr<uint8_t>(), s, block, nb, seg, kind, static_cast<float>(scale), scale != 1.0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor wire_dequantize_sum_cuda(const at::Tensor& wire_buf, int64_t world_size, int64_t block, int64_t kind,
                                    const at::Tensor& out, double scale, bool accumulate, bool stats) {
  check_cuda(wire_buf, "wire");
  check_cuda(out, "out");
  TORCH_CHECK(wire_buf.scalar_type() == at::kByte, "flatgrad::wire_dequantize_sum: wire must be uint8");
  TORCH_CHECK(wire_buf.device() == out.device(), "flatgrad::wire_dequantize_sum: wire is on ", wire_buf.device(),
              ", out on ", out.device(), "; both must be on one device");
  TORCH_CHECK(wire::scales_aligned(wire_buf.const_data_ptr()), "flatgrad::wire_dequantize_sum: wire must start at a ",
              "4-byte aligned address (its fp32 scales are read in place), got ", wire_buf.const_data_ptr());
  TORCH_CHECK(block >= 1 && block <= 4096 && world_size >= 1, "flatgrad::wire_dequantize_sum: bad block or world_size");
  TORCH_CHECK(kind == wire::kInt8 || kind == wire::kFp8, "flatgrad::wire_dequantize_sum: kind must be 0 or 1");
  const int64_t s = out.numel();
  TORCH_CHECK(wire_buf.numel() >= world_size * segment_bytes(s, block), "flatgrad::wire_dequantize_sum: wire too small");
  const int64_t blocks = nblocks(s, block);
  TORCH_CHECK(blocks <= INT32_MAX, "flatgrad::wire_dequantize_sum: too many blocks");
  const c10::cuda::CUDAGuard guard(out.device());
  const StatsBuffers buffers = stats_buffers(stats, blocks, out);
  if (s == 0) return buffers.result;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "wire_dequantize_sum", [&] {
    if (stats) {
      dequantize_sum_kernel<scalar_t, true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
          wire_buf.const_data_ptr<uint8_t>(), out.mutable_data_ptr<scalar_t>(), s, block, segment_bytes(s, block),
          world_size, kind, static_cast<float>(scale), accumulate, buffers.ptr());
    } else {
      dequantize_sum_kernel<scalar_t, false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
          wire_buf.const_data_ptr<uint8_t>(), out.mutable_data_ptr<scalar_t>(), s, block, segment_bytes(s, block),
          world_size, kind, static_cast<float>(scale), accumulate, nullptr);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  finish_stats(buffers, blocks, stream);
  return buffers.result;
}

void wire_requantize_cuda(const at::Tensor& wire_in, int64_t sources, int64_t block, int64_t kind,
                          const at::Tensor& wire_out, int64_t segments, int64_t shard_numel,
                          const std::optional<at::Tensor>& residual) {
  constexpr const char* op = "flatgrad::wire_requantize";
  check_cuda(wire_in, "wire_in");
  check_cuda(wire_out, "wire_out");
  if (residual.has_value()) check_cuda(*residual, "residual");
  const at::Device device = wire_out.device();
  const auto [s, part, seg_in, seg_out, nb] =
      wire::check_requantize(wire_in, sources, block, kind, wire_out, segments, shard_numel, residual, op);
  float* res = residual.has_value() ? residual->mutable_data_ptr<float>() : nullptr;
  if (s == 0) return;
  TORCH_CHECK(segments * nb <= INT32_MAX, op, ": too many blocks");
  const c10::cuda::CUDAGuard guard(device);
  auto stream = c10::cuda::getCurrentCUDAStream();
  requantize_kernel<<<static_cast<unsigned>(segments * nb), kThreads, 0, stream>>>(
      wire_in.const_data_ptr<uint8_t>(), res, wire_out.mutable_data_ptr<uint8_t>(), s, block, nb, part, seg_in,
      seg_out, sources, kind);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace cuda
}  // namespace flatgrad

TORCH_LIBRARY_IMPL(flatgrad, CUDA, m) {
  m.impl("wire_sum", &flatgrad::cuda::wire_sum_cuda);
  m.impl("wire_quantize", &flatgrad::cuda::wire_quantize_cuda);
  m.impl("wire_dequantize_sum", &flatgrad::cuda::wire_dequantize_sum_cuda);
  m.impl("_pack_quantize_table", &flatgrad::cuda::pack_quantize_table_cuda);
  m.impl("wire_requantize", &flatgrad::cuda::wire_requantize_cuda);
}
