// CUDA implementations of flatgrad::pack and flatgrad::unpack.
//
// The schemas are declared once in csrc/flatgrad.cpp (TORCH_LIBRARY); this
// file only provides the CUDA kernels (TORCH_LIBRARY_IMPL(flatgrad, CUDA)).
//
// Work decomposition: one block per run of the run table (see
// [Note: run tables] in flatgrad/layout.py), grid = R. The Python wrapper
// splits runs to at most _MAX_LEN["cuda"] elements, so blocks are of similar
// size and a bucket of any shape is one launch. Correctness does not depend
// on that bound: every loop strides over the run with int64 indices.
//
// The element loop itself (alignment choice, 16-byte vectors, scalar
// fallback, arithmetic) lives in flatgrad/cuda_copy.cuh; see
// [Note: CUDA arithmetic] there.
//
// Streams: every launch and copy goes to the current stream of the tensors'
// device, c10::cuda::getCurrentCUDAStream() (what at::cuda::getCurrentCUDAStream
// returns; ATen/cuda/CUDAContext.h is not included because it pulls in the
// cuBLAS/cuSPARSE headers, which a minimal CUDA toolkit lacks).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "flatgrad/cuda_copy.cuh"
#include "flatgrad/runs.h"

namespace flatgrad {
namespace cuda {
namespace {

// 8 warps per block. An 8192-element run is 1024 vectors of 8 elements when
// either side is 2-byte, or 2048 vectors of 4 for fp32 -> fp32: 4 or 8 per
// thread, loaded kVecUnroll at a time (one or two passes).
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Dtype codes of the per-call tensor table (column 1).
enum DtypeCode : int64_t { kCodeFloat = 0, kCodeBFloat16 = 1, kCodeHalf = 2 };

int64_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return kCodeFloat;
    case at::kBFloat16:
      return kCodeBFloat16;
    case at::kHalf:
      return kCodeHalf;
    default:
      return -1;
  }
}

// Where the data of tensor `index` of the call lives. The table is a
// per-call [T, 2] int64 device tensor (address, dtype code); with a single
// tensor (a plain unpack into one flat partition, or a one-tensor pack) the
// entry travels in the kernel arguments and no table is uploaded.
struct TensorTable {
  const int64_t* entries;  // [T, 2] on the device, or nullptr when T == 1
  int64_t address0;
  int64_t code0;

  __device__ __forceinline__ int64_t address(int64_t index) const {
    return entries == nullptr ? address0 : __ldg(entries + 2 * index);
  }
  __device__ __forceinline__ int64_t code(int64_t index) const {
    return entries == nullptr ? code0 : __ldg(entries + 2 * index + 1);
  }
};

// Sums two values over the block; the result is valid in thread 0. The order
// of additions is fixed by the thread layout, so the result is deterministic.
__device__ __forceinline__ void block_sum2(double& a, double& b) {
  __shared__ double partial[2][kWarps];
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
    a = lane < kWarps ? partial[0][lane] : 0.0;
    b = lane < kWarps ? partial[1][lane] : 0.0;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      a += __shfl_down_sync(0xffffffffu, a, offset);
      b += __shfl_down_sync(0xffffffffu, b, offset);
    }
  }
}

// One block per pack run: copy `valid` elements of the run's tensor (cast to
// out_t, scaled), then zero the rest of the run. The tensor's dtype is read
// per run from the table, so the switch is uniform over the block; each case
// is the same templated element loop.
template <typename out_t>
__global__ void __launch_bounds__(kThreads) pack_kernel(
    const int64_t* __restrict__ runs,
    TensorTable tensors,
    out_t* __restrict__ out,
    float scale,
    bool scaled) {
  const int64_t* row = runs + static_cast<int64_t>(blockIdx.x) * pack_col::kWidth;
  const int64_t dst_offset = __ldg(row + pack_col::kDstOffset);
  const int64_t tensor_index = __ldg(row + pack_col::kTensorIndex);
  const int64_t src_offset = __ldg(row + pack_col::kSrcOffset);
  const int64_t length = __ldg(row + pack_col::kLength);
  const int64_t valid = __ldg(row + pack_col::kValid);
  const int64_t tid = threadIdx.x;
  out_t* dst = out + dst_offset;
  if (valid > 0) {
    const int64_t address = tensors.address(tensor_index);
    switch (tensors.code(tensor_index)) {
      case kCodeFloat: {
        ElementOp<float, out_t, false, false> op(scale, scaled);
        copy_run(reinterpret_cast<const float*>(address) + src_offset, dst, valid, tid, kThreads, op);
        break;
      }
      case kCodeBFloat16: {
        ElementOp<c10::BFloat16, out_t, false, false> op(scale, scaled);
        copy_run(reinterpret_cast<const c10::BFloat16*>(address) + src_offset, dst, valid, tid, kThreads, op);
        break;
      }
      case kCodeHalf: {
        ElementOp<c10::Half, out_t, false, false> op(scale, scaled);
        copy_run(reinterpret_cast<const c10::Half*>(address) + src_offset, dst, valid, tid, kThreads, op);
        break;
      }
      default:
        break;  // unreachable: the host wrote the codes and checked every dtype
    }
  }
  if (length > valid) {
    zero_run(dst + valid, length - valid, tid, kThreads);
  }
}

// One block per unpack run: shard[src_offset, +length) into
// outs[out_index][out_offset, +length). With kStats the block's sum of
// squares and non-finite count of the values written go to partials[run]
// (double: exact counts, and the partial sums lose nothing more); the
// fixed-order stats_finish_kernel reduces them. No float atomics anywhere.
template <typename in_t, typename out_t, bool kAccumulate, bool kStats>
__global__ void __launch_bounds__(kThreads) unpack_kernel(
    const int64_t* __restrict__ runs,
    const in_t* __restrict__ shard,
    TensorTable outs,
    float scale,
    bool scaled,
    double* __restrict__ partials) {
  const int64_t run = blockIdx.x;
  const int64_t* row = runs + run * unpack_col::kWidth;
  const int64_t src_offset = __ldg(row + unpack_col::kSrcOffset);
  const int64_t out_index = __ldg(row + unpack_col::kOutIndex);
  const int64_t out_offset = __ldg(row + unpack_col::kOutOffset);
  const int64_t length = __ldg(row + unpack_col::kLength);
  out_t* dst = reinterpret_cast<out_t*>(outs.address(out_index)) + out_offset;
  ElementOp<in_t, out_t, kAccumulate, kStats> op(scale, scaled);
  copy_run(shard + src_offset, dst, length, static_cast<int64_t>(threadIdx.x), kThreads, op);
  if constexpr (kStats) {
    double sum_sq = op.sum_sq;
    double nonfinite = static_cast<double>(op.nonfinite);
    block_sum2(sum_sq, nonfinite);
    if (threadIdx.x == 0) {
      partials[2 * run] = sum_sq;
      partials[2 * run + 1] = nonfinite;
    }
  }
}

// result = [sum of partials[:, 0], sum of partials[:, 1]] as fp32, by one
// block in a fixed order (deterministic for a given run table).
__global__ void __launch_bounds__(kThreads)
    stats_finish_kernel(const double* __restrict__ partials, int64_t num_runs, float* __restrict__ result) {
  double sum_sq = 0.0;
  double nonfinite = 0.0;
  for (int64_t run = threadIdx.x; run < num_runs; run += kThreads) {
    sum_sq += partials[2 * run];
    nonfinite += partials[2 * run + 1];
  }
  block_sum2(sum_sq, nonfinite);
  if (threadIdx.x == 0) {
    result[0] = static_cast<float>(sum_sq);
    result[1] = static_cast<float>(nonfinite);
  }
}

void check_dtype(const char* op, const std::string& name, at::ScalarType t) {
  TORCH_CHECK(dtype_code(t) >= 0, "flatgrad::", op, ": ", name, " has dtype ", t, "; supported: fp32, bf16, fp16");
}

void check_runs(const char* op, const at::Tensor& runs, const at::Device& device, int64_t width) {
  TORCH_CHECK(runs.device() == device, "flatgrad::", op, ": runs is on ", runs.device(), ", expected ", device);
  TORCH_CHECK(runs.scalar_type() == at::kLong, "flatgrad::", op, ": runs must be int64, got ", runs.scalar_type());
  TORCH_CHECK(
      runs.dim() == 2 && runs.size(1) == width,
      "flatgrad::", op, ": runs must have shape [R, ", width, "], got ", runs.sizes());
  TORCH_CHECK(runs.is_contiguous(), "flatgrad::", op, ": runs must be contiguous");
  TORCH_CHECK(
      runs.size(0) <= std::numeric_limits<int32_t>::max(),
      "flatgrad::", op, ": ", runs.size(0), " runs exceed the grid limit; split the layout into buckets");
}

void check_operand(const char* op, const std::string& name, const at::Tensor& t, const at::Device& device) {
  TORCH_CHECK(t.device() == device, "flatgrad::", op, ": ", name, " is on ", t.device(), ", expected ", device);
  TORCH_CHECK(t.is_contiguous(), "flatgrad::", op, ": ", name, " must be contiguous");
  check_dtype(op, name, t.scalar_type());
}

// The per-call tensor table: a pinned host tensor filled here and copied to
// the device with non_blocking=true on the current stream (an async H2D copy
// ordered before the kernel, not a host sync; the caching host allocator
// keeps the pinned block alive until the copy has run). A single tensor
// needs no table: its entry goes in the kernel arguments.
TensorTable make_table(at::TensorList tensors, const at::Device& device, at::Tensor& keep_alive) {
  const int64_t count = static_cast<int64_t>(tensors.size());
  if (count == 0) {
    return TensorTable{nullptr, 0, -1};
  }
  if (count == 1) {
    return TensorTable{
        nullptr, reinterpret_cast<int64_t>(tensors[0].data_ptr()), dtype_code(tensors[0].scalar_type())};
  }
  // Under CUDA graph capture the copy would be recorded from a pinned block that is
  // recycled after capture, so replays would read stale pointers: refuse clearly.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device.index()).stream(), &capture));
  TORCH_CHECK(capture == cudaStreamCaptureStatusNone,
              "flatgrad (CUDA): pack/unpack of several tensors cannot be captured in a CUDA graph "
              "(the per-call tensor table is uploaded from host memory)");
  at::Tensor host = at::empty({count, 2}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* entries = host.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    entries[2 * i] = reinterpret_cast<int64_t>(tensors[i].data_ptr());
    entries[2 * i + 1] = dtype_code(tensors[i].scalar_type());
  }
  keep_alive = at::empty({count, 2}, at::TensorOptions().dtype(at::kLong).device(device));
  keep_alive.copy_(host, /*non_blocking=*/true);
  return TensorTable{keep_alive.data_ptr<int64_t>(), 0, -1};
}

void pack_cuda(at::TensorList tensors, const at::Tensor& runs, const at::Tensor& out, double scale) {
  const char* op = "pack";
  TORCH_CHECK(out.is_cuda(), "flatgrad::pack (CUDA): out must be a CUDA tensor, got ", out.device());
  const at::Device device = out.device();
  check_operand(op, "out", out, device);
  check_runs(op, runs, device, pack_col::kWidth);
  for (size_t i = 0; i < tensors.size(); ++i) {
    check_operand(op, "tensors[" + std::to_string(i) + "]", tensors[i], device);
  }
  const int64_t num_runs = runs.size(0);
  if (num_runs == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor table_storage;
  const TensorTable table = make_table(tensors, device, table_storage);
  const float scale_f = static_cast<float>(scale);
  const bool scaled = scale != 1.0;
  AT_DISPATCH_SWITCH(
      out.scalar_type(),
      "flatgrad::pack",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        pack_kernel<scalar_t><<<static_cast<unsigned>(num_runs), kThreads, 0, stream>>>(
            runs.data_ptr<int64_t>(), table, out.data_ptr<scalar_t>(), scale_f, scaled);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
        pack_kernel<scalar_t><<<static_cast<unsigned>(num_runs), kThreads, 0, stream>>>(
            runs.data_ptr<int64_t>(), table, out.data_ptr<scalar_t>(), scale_f, scaled);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }) AT_DISPATCH_CASE(at::kHalf, [&] {
        pack_kernel<scalar_t><<<static_cast<unsigned>(num_runs), kThreads, 0, stream>>>(
            runs.data_ptr<int64_t>(), table, out.data_ptr<scalar_t>(), scale_f, scaled);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }));
}

template <typename in_t, typename out_t>
void launch_unpack(
    const at::Tensor& shard,
    const at::Tensor& runs,
    const TensorTable& table,
    float scale,
    bool scaled,
    bool accumulate,
    double* partials,
    cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(runs.size(0));
  const int64_t* run_ptr = runs.data_ptr<int64_t>();
  const in_t* src = shard.data_ptr<in_t>();
  // Four instantiations so that the copy-only loop carries neither the
  // destination load nor the statistics.
  if (accumulate) {
    if (partials != nullptr) {
      unpack_kernel<in_t, out_t, true, true><<<grid, kThreads, 0, stream>>>(run_ptr, src, table, scale, scaled, partials);
    } else {
      unpack_kernel<in_t, out_t, true, false><<<grid, kThreads, 0, stream>>>(run_ptr, src, table, scale, scaled, partials);
    }
  } else {
    if (partials != nullptr) {
      unpack_kernel<in_t, out_t, false, true><<<grid, kThreads, 0, stream>>>(run_ptr, src, table, scale, scaled, partials);
    } else {
      unpack_kernel<in_t, out_t, false, false><<<grid, kThreads, 0, stream>>>(run_ptr, src, table, scale, scaled, partials);
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename in_t>
void dispatch_unpack_out(
    at::ScalarType out_dtype,
    const at::Tensor& shard,
    const at::Tensor& runs,
    const TensorTable& table,
    float scale,
    bool scaled,
    bool accumulate,
    double* partials,
    cudaStream_t stream) {
  AT_DISPATCH_SWITCH(
      out_dtype,
      "flatgrad::unpack",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        launch_unpack<in_t, scalar_t>(shard, runs, table, scale, scaled, accumulate, partials, stream);
      }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
        launch_unpack<in_t, scalar_t>(shard, runs, table, scale, scaled, accumulate, partials, stream);
      }) AT_DISPATCH_CASE(at::kHalf, [&] {
        launch_unpack<in_t, scalar_t>(shard, runs, table, scale, scaled, accumulate, partials, stream);
      }));
}

at::Tensor unpack_cuda(
    const at::Tensor& shard,
    const at::Tensor& runs,
    at::TensorList outs,
    double scale,
    bool accumulate,
    bool stats) {
  const char* op = "unpack";
  TORCH_CHECK(shard.is_cuda(), "flatgrad::unpack (CUDA): shard must be a CUDA tensor, got ", shard.device());
  const at::Device device = shard.device();
  check_operand(op, "shard", shard, device);
  check_runs(op, runs, device, unpack_col::kWidth);
  for (size_t k = 0; k < outs.size(); ++k) {
    check_operand(op, "outs[" + std::to_string(k) + "]", outs[k], device);
    TORCH_CHECK(
        outs[k].scalar_type() == outs[0].scalar_type(),
        "flatgrad::unpack: outs[", k, "] has dtype ", outs[k].scalar_type(), ", outs[0] has ", outs[0].scalar_type(),
        "; use one dtype");
  }
  const int64_t num_runs = runs.size(0);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  if (num_runs == 0) {
    return stats ? at::zeros({2}, f32) : at::empty({0}, f32);
  }
  TORCH_CHECK(!outs.empty(), "flatgrad::unpack: outs is empty but runs has ", num_runs, " rows");

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor table_storage;
  const TensorTable table = make_table(outs, device, table_storage);
  at::Tensor partials;
  at::Tensor result = at::empty({stats ? 2 : 0}, f32);
  if (stats) {
    partials = at::empty({num_runs, 2}, at::TensorOptions().dtype(at::kDouble).device(device));
  }
  double* partial_ptr = stats ? partials.data_ptr<double>() : nullptr;
  const float scale_f = static_cast<float>(scale);
  const bool scaled = scale != 1.0;
  const at::ScalarType out_dtype = outs[0].scalar_type();
  AT_DISPATCH_SWITCH(
      shard.scalar_type(),
      "flatgrad::unpack",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        dispatch_unpack_out<scalar_t>(out_dtype, shard, runs, table, scale_f, scaled, accumulate, partial_ptr, stream);
      }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
        dispatch_unpack_out<scalar_t>(out_dtype, shard, runs, table, scale_f, scaled, accumulate, partial_ptr, stream);
      }) AT_DISPATCH_CASE(at::kHalf, [&] {
        dispatch_unpack_out<scalar_t>(out_dtype, shard, runs, table, scale_f, scaled, accumulate, partial_ptr, stream);
      }));
  if (stats) {
    stats_finish_kernel<<<1, kThreads, 0, stream>>>(partial_ptr, num_runs, result.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return result;
}

}  // namespace
}  // namespace cuda
}  // namespace flatgrad

TORCH_LIBRARY_IMPL(flatgrad, CUDA, m) {
  m.impl("pack", &flatgrad::cuda::pack_cuda);
  m.impl("unpack", &flatgrad::cuda::unpack_cuda);
}
