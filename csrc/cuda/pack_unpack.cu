// CUDA implementations of flatgrad::pack and flatgrad::unpack.
//
// The schemas are declared once in csrc/flatgrad.cpp (TORCH_LIBRARY); this
// file only provides the CUDA kernels (TORCH_LIBRARY_IMPL(flatgrad, CUDA)).
//
// Work decomposition: one block per run of the run table (see
// [Note: run tables] in docs/design.md), grid = R. The Python wrapper
// splits runs to at most _MAX_LEN["cuda"] elements, so blocks are of similar
// size and a bucket of any shape is one launch. Correctness does not depend
// on that bound: every loop strides over the run with int64 indices.
//
// The element loop itself (alignment choice, 16-byte vectors, scalar
// fallback, arithmetic) lives in flatgrad/cuda_copy.cuh; see
// [Note: CUDA arithmetic] in docs/design.md.
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
#include <string>
#include <vector>

#include "flatgrad/cuda_copy.cuh"
#include "flatgrad/cuda_stats.cuh"
#include "flatgrad/runs.h"

namespace flatgrad {
namespace cuda {
namespace {

// 8 warps per block. An 8192-element run is 1024 vectors of 8 elements when
// either side is 2-byte, or 2048 vectors of 4 for fp32 -> fp32: 4 or 8 per
// thread, loaded kVecUnroll at a time (one or two passes).
constexpr int kThreads = 256;
static_assert(kThreads == kStatsThreads, "the stats reduction (flatgrad/cuda_stats.cuh) assumes 256 threads");

// Where the data of tensor `index` of the call lives. The table is an int64
// [T, 2] device tensor of (address, dtype code) rows (see table_col in
// flatgrad/runs.h): made per call by the plain ops, or kept on the device by a
// plan (the _*_table ops). With a single tensor the plain ops pass the entry
// in the kernel arguments and upload no table. Address 0 is a missing tensor.
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
  // A missing tensor (address 0) packs as zeros, as padding does.
  const int64_t address = valid > 0 ? tensors.address(tensor_index) : 0;
  const int64_t copied = address != 0 ? valid : 0;
  if (copied > 0) {
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
  if (length > copied) {
    zero_run(dst + copied, length - copied, tid, kThreads);
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
// needs no table: its entry goes in the kernel arguments. `address(i)` and
// `code(i)` give entry i (address 0: a missing tensor).
template <typename Address, typename Code>
TensorTable make_table(int64_t count, Address address, Code code, const at::Device& device, at::Tensor& keep_alive) {
  if (count == 0) {
    return TensorTable{nullptr, 0, -1};
  }
  if (count == 1) {
    return TensorTable{nullptr, address(0), code(0)};
  }
  // Under CUDA graph capture the copy would be recorded from a pinned block that is
  // recycled after capture, so replays would read stale pointers: refuse clearly.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device.index()).stream(), &capture));
  TORCH_CHECK(capture == cudaStreamCaptureStatusNone,
              "flatgrad (CUDA): pack/unpack of several tensors cannot be captured in a CUDA graph "
              "(the per-call tensor table is uploaded from host memory); use a flatgrad.PackPlan / UnpackPlan, "
              "whose table stays on the device");
  at::Tensor host = at::empty({count, table_col::kWidth}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* entries = host.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    entries[table_col::kWidth * i + table_col::kAddress] = address(i);
    entries[table_col::kWidth * i + table_col::kCode] = code(i);
  }
  keep_alive = at::empty({count, table_col::kWidth}, at::TensorOptions().dtype(at::kLong).device(device));
  keep_alive.copy_(host, /*non_blocking=*/true);
  return TensorTable{keep_alive.data_ptr<int64_t>(), 0, -1};
}

// A plan's table, already on the device (see [Note: plans] in docs/design.md).
TensorTable device_table(const char* op, const at::Tensor& table, const at::Device& device) {
  TORCH_CHECK(table.device() == device, "flatgrad::", op, ": table is on ", table.device(), ", expected ", device);
  TORCH_CHECK(
      table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == table_col::kWidth &&
          table.is_contiguous(),
      "flatgrad::", op, ": table must be a contiguous int64 tensor of shape [T, ", table_col::kWidth, "], got ",
      table.scalar_type(), " ", table.sizes());
  return TensorTable{table.data_ptr<int64_t>(), 0, -1};
}

void launch_pack(const at::Tensor& runs, const TensorTable& table, const at::Tensor& out, double scale) {
  const int64_t num_runs = runs.size(0);
  if (num_runs == 0) {
    return;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
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

// The checks every pack op makes of `out` and `runs`; returns the device.
at::Device check_pack_operands(const char* op, const at::Tensor& out, const at::Tensor& runs) {
  TORCH_CHECK(out.is_cuda(), "flatgrad::", op, " (CUDA): out must be a CUDA tensor, got ", out.device());
  const at::Device device = out.device();
  check_operand(op, "out", out, device);
  check_runs(op, runs, device, pack_col::kWidth);
  return device;
}

// The checks every unpack op makes of `shard` and `runs`; returns the device.
at::Device check_unpack_operands(const char* op, const at::Tensor& shard, const at::Tensor& runs) {
  TORCH_CHECK(shard.is_cuda(), "flatgrad::", op, " (CUDA): shard must be a CUDA tensor, got ", shard.device());
  const at::Device device = shard.device();
  check_operand(op, "shard", shard, device);
  check_runs(op, runs, device, unpack_col::kWidth);
  return device;
}

void pack_cuda(const c10::List<std::optional<at::Tensor>>& tensors, const at::Tensor& runs, const at::Tensor& out,
               double scale) {
  const char* op = "pack";
  const at::Device device = check_pack_operands(op, out, runs);
  const int64_t count = static_cast<int64_t>(tensors.size());
  std::vector<int64_t> addresses(count, 0);
  std::vector<int64_t> codes(count, kCodeNone);
  for (int64_t i = 0; i < count; ++i) {
    const std::optional<at::Tensor> t = tensors[i];
    if (t.has_value()) {
      check_operand(op, "tensors[" + std::to_string(i) + "]", *t, device);
      addresses[i] = reinterpret_cast<int64_t>(t->data_ptr());
      codes[i] = dtype_code(t->scalar_type());
    }
  }
  if (runs.size(0) == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor table_storage;
  const TensorTable table = make_table(
      count, [&](int64_t i) { return addresses[i]; }, [&](int64_t i) { return codes[i]; }, device, table_storage);
  launch_pack(runs, table, out, scale);
}

void pack_table_cuda(const at::Tensor& table, const at::Tensor& runs, const at::Tensor& out, double scale) {
  const char* op = "_pack_table";
  const at::Device device = check_pack_operands(op, out, runs);
  const c10::cuda::CUDAGuard guard(device);
  launch_pack(runs, device_table(op, table, device), out, scale);
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

// Launches the unpack of `shard` along `runs` into the tensors of `table`
// (all of dtype out_dtype); returns the stats (or an empty tensor).
at::Tensor launch_unpack_all(
    const at::Tensor& shard,
    const at::Tensor& runs,
    const TensorTable& table,
    at::ScalarType out_dtype,
    double scale,
    bool accumulate,
    bool stats) {
  const int64_t num_runs = runs.size(0);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(shard.device());
  if (num_runs == 0) {
    return stats ? at::zeros({2}, f32) : at::empty({0}, f32);
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor partials;
  at::Tensor result = at::empty({stats ? 2 : 0}, f32);
  if (stats) {
    partials = at::empty({num_runs, 2}, at::TensorOptions().dtype(at::kDouble).device(shard.device()));
  }
  double* partial_ptr = stats ? partials.data_ptr<double>() : nullptr;
  const float scale_f = static_cast<float>(scale);
  const bool scaled = scale != 1.0;
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
    stats_finish_kernel<<<1, kStatsThreads, 0, stream>>>(partial_ptr, num_runs, result.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return result;
}

at::Tensor unpack_cuda(
    const at::Tensor& shard,
    const at::Tensor& runs,
    at::TensorList outs,
    double scale,
    bool accumulate,
    bool stats) {
  const char* op = "unpack";
  const at::Device device = check_unpack_operands(op, shard, runs);
  for (size_t k = 0; k < outs.size(); ++k) {
    check_operand(op, "outs[" + std::to_string(k) + "]", outs[k], device);
    TORCH_CHECK(
        outs[k].scalar_type() == outs[0].scalar_type(),
        "flatgrad::unpack: outs[", k, "] has dtype ", outs[k].scalar_type(), ", outs[0] has ", outs[0].scalar_type(),
        "; use one dtype");
  }
  TORCH_CHECK(!outs.empty() || runs.size(0) == 0, "flatgrad::unpack: outs is empty but runs has ", runs.size(0),
              " rows");
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor table_storage;
  const TensorTable table = runs.size(0) == 0
      ? TensorTable{nullptr, 0, -1}
      : make_table(
            static_cast<int64_t>(outs.size()),
            [&](int64_t i) { return reinterpret_cast<int64_t>(outs[i].data_ptr()); },
            [&](int64_t i) { return dtype_code(outs[i].scalar_type()); }, device, table_storage);
  const at::ScalarType out_dtype = outs.empty() ? at::kFloat : outs[0].scalar_type();
  return launch_unpack_all(shard, runs, table, out_dtype, scale, accumulate, stats);
}

at::Tensor unpack_table_cuda(
    const at::Tensor& shard,
    const at::Tensor& runs,
    const at::Tensor& table,
    at::ScalarType out_dtype,
    double scale,
    bool accumulate,
    bool stats) {
  const char* op = "_unpack_table";
  const at::Device device = check_unpack_operands(op, shard, runs);
  check_dtype(op, "out_dtype", out_dtype);
  const c10::cuda::CUDAGuard guard(device);
  return launch_unpack_all(shard, runs, device_table(op, table, device), out_dtype, scale, accumulate, stats);
}

}  // namespace
}  // namespace cuda
}  // namespace flatgrad

TORCH_LIBRARY_IMPL(flatgrad, CUDA, m) {
  m.impl("pack", &flatgrad::cuda::pack_cuda);
  m.impl("unpack", &flatgrad::cuda::unpack_cuda);
  m.impl("_pack_table", &flatgrad::cuda::pack_table_cuda);
  m.impl("_unpack_table", &flatgrad::cuda::unpack_table_cuda);
}
