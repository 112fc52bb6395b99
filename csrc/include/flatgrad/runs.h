// Run-table columns shared by every compiled backend.
// See [Note: run tables] in flatgrad/layout.py: the tables are int64 [R, 5]
// (pack) and [R, 4] (unpack), row-major, made once per layout and device.
#pragma once

#include <cstdint>

namespace flatgrad {

// Pack run: buffer[dst_offset, dst_offset + length) gets its first `valid`
// elements from tensors[tensor_index].view(-1)[src_offset:], zeros after.
// tensor_index == -1 marks pure padding (valid == 0).
namespace pack_col {
constexpr int64_t kDstOffset = 0;
constexpr int64_t kTensorIndex = 1;
constexpr int64_t kSrcOffset = 2;
constexpr int64_t kLength = 3;
constexpr int64_t kValid = 4;
constexpr int64_t kWidth = 5;
}  // namespace pack_col

// Unpack run: shard[src_offset, src_offset + length) goes to
// outs[out_index].view(-1)[out_offset, out_offset + length).
namespace unpack_col {
constexpr int64_t kSrcOffset = 0;
constexpr int64_t kOutIndex = 1;
constexpr int64_t kOutOffset = 2;
constexpr int64_t kLength = 3;
constexpr int64_t kWidth = 4;
}  // namespace unpack_col

}  // namespace flatgrad
