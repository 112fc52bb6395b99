// Run-table columns shared by every compiled backend.
// See [Note: run tables] in docs/design.md: the tables are int64 [R, 5]
// (pack) and [R, 4] (unpack), row-major, made once per layout and device.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <c10/core/ScalarType.h>

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

// The run k with start[k] <= pos < start[k + 1], where start (R + 1 entries) holds
// every run's first element and the total; start is sorted, and an empty run is
// never returned, as upper_bound skips past it. Host code (the CPU kernels).
inline int64_t find_run(const std::vector<int64_t>& start, int64_t pos) {
  const auto it = std::upper_bound(start.begin(), start.end() - 1, pos);
  return static_cast<int64_t>(it - start.begin()) - 1;
}

// Walks the pack runs over buffer elements [begin, end) (a pack table, with
// start as for find_run): data(tensor_index, src_element, pos, n) for the n
// elements from pos that come from a run's tensor, when has_data(tensor_index)
// (a missing tensor has none); zeros(pos, n) for padding and missing tensors.
template <class HasData, class Data, class Zeros>
inline void walk_pack_runs(const std::vector<int64_t>& start, const int64_t* table, int64_t begin, int64_t end,
                           HasData&& has_data, Data&& data, Zeros&& zeros) {
  for (int64_t k = find_run(start, begin), pos = begin; pos < end; ++k) {
    const int64_t* r = table + k * pack_col::kWidth;
    const int64_t run_end = std::min(end, start[k + 1]);
    const int64_t valid_end = std::min(run_end, start[k] + r[pack_col::kValid]);
    if (pos < valid_end && has_data(r[pack_col::kTensorIndex])) {
      data(r[pack_col::kTensorIndex], r[pack_col::kSrcOffset] + (pos - start[k]), pos, valid_end - pos);
      pos = valid_end;
    }
    if (pos < run_end) {
      zeros(pos, run_end - pos);
      pos = run_end;
    }
  }
}

// Tensor tables: int64 [T, 2] rows (address, dtype code), one per tensor of a
// call. The CUDA ops build one per call; a PackPlan / UnpackPlan keeps one (see
// [Note: plans] in docs/design.md). Address 0 means "no source":
// pack writes zeros for that tensor's whole range.
namespace table_col {
constexpr int64_t kAddress = 0;
constexpr int64_t kCode = 1;
constexpr int64_t kWidth = 2;
}  // namespace table_col

// Dtype codes of tensor tables; kNone marks a missing tensor (address 0).
enum DtypeCode : int64_t { kCodeNone = -1, kCodeFloat = 0, kCodeBFloat16 = 1, kCodeHalf = 2 };

inline int64_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return kCodeFloat;
    case at::kBFloat16:
      return kCodeBFloat16;
    case at::kHalf:
      return kCodeHalf;
    default:
      return kCodeNone;
  }
}

// The dtype of a code >= 0 (kFloat for anything else; callers check codes first).
inline at::ScalarType code_dtype(int64_t code) {
  return code == kCodeBFloat16 ? at::kBFloat16 : (code == kCodeHalf ? at::kHalf : at::kFloat);
}

}  // namespace flatgrad
