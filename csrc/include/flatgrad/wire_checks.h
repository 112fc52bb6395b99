// The device-independent argument checks of flatgrad::wire_requantize, shared by its CPU
// (csrc/wire.cpp) and CUDA (csrc/cuda/wire.cu) kernels; each adds its own device checks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

#include "flatgrad/wire.h"

namespace flatgrad {
namespace wire {

// Sizes of one requantize: S, the partial's N * S, the input and output segment bytes, blocks per output segment.
struct RequantizeSizes {
  int64_t s, part, seg_in, seg_out, nb;
};

inline RequantizeSizes check_requantize(const at::Tensor& wire_in, int64_t sources, int64_t block, int64_t kind,
                                        const at::Tensor& wire_out, int64_t segments, int64_t shard_numel,
                                        const std::optional<at::Tensor>& residual, const char* op) {
  TORCH_CHECK(wire_in.scalar_type() == at::kByte && wire_out.scalar_type() == at::kByte, op,
              ": wire_in and wire_out must be uint8");
  TORCH_CHECK(wire_in.device() == wire_out.device(), op, ": wire_in is on ", wire_in.device(), ", wire_out on ",
              wire_out.device(), "; both must be on one device");
  TORCH_CHECK(scales_aligned(wire_in.const_data_ptr()) && scales_aligned(wire_out.const_data_ptr()), op,
              ": wire_in and wire_out must start at 4-byte aligned addresses (their fp32 scales are accessed in ",
              "place), got ", wire_in.const_data_ptr(), " and ", wire_out.const_data_ptr());
  TORCH_CHECK(block >= 1 && block <= 4096 && sources >= 1 && segments >= 1 && shard_numel >= 0, op,
              ": bad block, sources, segments or shard_numel");
  TORCH_CHECK(kind == kInt8 || kind == kFp8, op, ": kind must be 0 (int8) or 1 (fp8)");
  const int64_t s = shard_numel, part = segments * s;
  const RequantizeSizes sizes{s, part, segment_bytes(part, block), segment_bytes(s, block), nblocks(s, block)};
  TORCH_CHECK(wire_in.numel() >= sources * sizes.seg_in, op, ": wire_in has ", wire_in.numel(), " bytes, needs ",
              sources * sizes.seg_in);
  TORCH_CHECK(wire_out.numel() >= segments * sizes.seg_out, op, ": wire_out has ", wire_out.numel(),
              " bytes, needs ", segments * sizes.seg_out);
  if (residual.has_value()) {
    TORCH_CHECK(residual->device() == wire_out.device() && residual->scalar_type() == at::kFloat &&
                    residual->numel() == part,
                op, ": residual must be fp32 with segments * shard_numel (", part, ") elements on ",
                wire_out.device());
  }
  return sizes;
}

}  // namespace wire
}  // namespace flatgrad
