// The fused pack-quantize of the int8/fp8 reduction modes: schema and CPU kernel.
//
// _pack_quantize_table: wire <- blockwise int8/fp8 of the fp32 pack of a plan's
// tensors (+ residual), without the packed buffer. See [Note: pack-quantize] in
// docs/design.md for the contract (the reference is the
// oracle, bit for bit), [Note: wire format] for the bytes written, and
// [Note: plans] in docs/design.md for the tensor table.
//
// Work: one quantization block (destination w, block j) at a time, in parallel
// over blocks. A block's elements are gathered along the pack run table (binary
// search for its first run, then the runs in order) into an fp32 array on the
// stack (at most 4096 floats, 16 KiB: it stays in L1), cast and scaled as the
// regular pack does (padding and missing tensors are zeros); the absmax pass
// (which adds the residual in place) and the quantize pass then read that
// array, so every source element is read from memory once.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "flatgrad/runs.h"
#include "flatgrad/wire.h"
#include "flatgrad/wire_cpu.h"

namespace flatgrad {
namespace {

// Blocks of elements per unit of parallel work: about 32K elements.
constexpr int64_t kGrain = 32768;

// The element loops are compiled for AVX2 and for the x86-64 baseline, as in
// csrc/flatgrad.cpp (no FMA is enabled, so both compute the same bits); the
// baseline has no vector round-to-integer, so nearbyint is a call per element there.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FLATGRAD_PQ_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FLATGRAD_PQ_CLONES
#endif

// x[i] = float(src[i]), times scale when `scaled` (the regular pack's arithmetic to fp32).
template <typename in_t>
FLATGRAD_PQ_CLONES void load_span(const void* src, float* x, int64_t n, bool scaled, float scale) {
  const in_t* s = static_cast<const in_t*>(src);
  if (scaled) {
    for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(s[i]) * scale;
  } else {
    for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(s[i]);
  }
}

void load_any(const char* src, int64_t code, float* x, int64_t n, bool scaled, float scale) {
  switch (code) {
    case kCodeFloat:
      return load_span<float>(src, x, n, scaled, scale);
    case kCodeBFloat16:
      return load_span<c10::BFloat16>(src, x, n, scaled, scale);
    case kCodeHalf:
      return load_span<c10::Half>(src, x, n, scaled, scale);
    default:
      TORCH_INTERNAL_ASSERT(false, "flatgrad::_pack_quantize_table: dtype code ", code);  // checked below
  }
}

FLATGRAD_PQ_CLONES void quantize_x(float* x, float* res, int64_t n, int64_t kind, uint8_t* values, float* scale_out) {
  wire::quantize_values(x, res, n, kind, values, scale_out);
}

struct Source {
  const char* data;  // nullptr: a missing tensor (zeros)
  int64_t code;
  int64_t itemsize;
};

void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() == 1, "flatgrad::_pack_quantize_table: ", what,
              " must be a contiguous 1-D CPU tensor");
}

void pack_quantize_table_cpu(const at::Tensor& table, const at::Tensor& runs, int64_t numel, int64_t world_size,
                             int64_t block,
                             int64_t kind, double scale, const at::Tensor& wire_buf,
                             const std::optional<at::Tensor>& residual) {
  constexpr const char* op = "flatgrad::_pack_quantize_table";
  using namespace pack_col;
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == table_col::kWidth &&
                  table.device().is_cpu() && table.is_contiguous(),
              op, ": table must be a contiguous int64 CPU tensor of shape [T, ", table_col::kWidth, "]");
  TORCH_CHECK(runs.scalar_type() == at::kLong && runs.dim() == 2 && runs.size(1) == kWidth && runs.device().is_cpu() &&
                  runs.is_contiguous(),
              op, ": runs must be a contiguous int64 CPU tensor of shape [R, ", kWidth, "]");
  check_cpu(wire_buf, "wire");
  TORCH_CHECK(wire_buf.scalar_type() == at::kByte, op, ": wire must be uint8");
  TORCH_CHECK(wire::scales_aligned(wire_buf.const_data_ptr()), op, ": wire must start at a 4-byte aligned address ",
              "(its fp32 scales are written in place), got ", wire_buf.const_data_ptr());
  TORCH_CHECK(block >= 1 && block <= 4096, op, ": block must be in [1, 4096], got ", block);
  TORCH_CHECK(kind == wire::kInt8 || kind == wire::kFp8, op, ": kind must be 0 (int8) or 1 (fp8), got ", kind);

  // The tensors of the plan's table.
  const int64_t num_tensors = table.size(0);
  std::vector<Source> sources(num_tensors);
  const int64_t* row = table.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < num_tensors; ++i, row += table_col::kWidth) {
    const int64_t address = row[table_col::kAddress], code = row[table_col::kCode];
    TORCH_CHECK(address == 0 || (code >= kCodeFloat && code <= kCodeHalf), op, ": table[", i, "] has dtype code ",
                code);
    sources[i] = {reinterpret_cast<const char*>(address), code,
                  address == 0 ? 0 : static_cast<int64_t>(c10::elementSize(code_dtype(code)))};
  }

  // The runs must tile [0, total) in order; start[k] is run k's first element.
  const int64_t num_runs = runs.size(0);
  const int64_t* rt = runs.const_data_ptr<int64_t>();
  std::vector<int64_t> start(num_runs + 1);
  int64_t total = 0;
  for (int64_t k = 0; k < num_runs; ++k) {
    const int64_t* r = rt + k * kWidth;
    TORCH_CHECK(r[kDstOffset] == total && r[kLength] >= 0 && r[kValid] >= 0 && r[kValid] <= r[kLength], op,
                ": runs[", k, "] does not continue the tiling of the buffer");
    TORCH_CHECK(r[kValid] == 0 || (r[kTensorIndex] >= 0 && r[kTensorIndex] < num_tensors), op, ": runs[", k,
                "] reads tensors[", r[kTensorIndex], "] of ", num_tensors);
    start[k] = total;
    total += r[kLength];
  }
  start[num_runs] = total;
  TORCH_CHECK(total == numel, op, ": the runs cover ", total, " elements, numel is ", numel);
  TORCH_CHECK(world_size >= 1 && total % world_size == 0, op, ": numel ", total, " is not a multiple of world_size ",
              world_size);
  const int64_t s = total / world_size;
  const int64_t nb = wire::nblocks(s, block), seg = wire::segment_bytes(s, block);
  TORCH_CHECK(wire_buf.numel() >= world_size * seg, op, ": wire has ", wire_buf.numel(), " bytes, needs ",
              world_size * seg);
  float* res = nullptr;
  if (residual.has_value()) {
    check_cpu(*residual, "residual");
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->numel() == total, op,
                ": residual must be fp32 with one element per buffer element (", total, ")");
    res = residual->mutable_data_ptr<float>();
  }
  if (s == 0) return;

  const bool scaled = scale != 1.0;
  const float fscale = static_cast<float>(scale);
  uint8_t* out = wire_buf.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, world_size * nb, std::max<int64_t>(1, kGrain / block), [&](int64_t begin, int64_t end) {
    float x[4096];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t w = i / nb, j = i % nb;
      const int64_t first = j * block, n = std::min(block, s - first);
      if (n <= 0) continue;  // never (j < nb); tells gcc that n > 0
      const int64_t p0 = w * s + first, p1 = p0 + n;
      // Gather the block's fp32 pack along the runs.
      walk_pack_runs(
          start, rt, p0, p1, [&](int64_t t) { return sources[t].data != nullptr; },
          [&](int64_t t, int64_t at, int64_t pos, int64_t len) {
            const Source& src = sources[t];
            load_any(src.data + at * src.itemsize, src.code, x + (pos - p0), len, scaled, fscale);
          },
          [&](int64_t pos, int64_t len) { std::fill(x + (pos - p0), x + (pos - p0 + len), 0.0f); });  // padding, missing
      uint8_t* segment = out + w * seg;
      quantize_x(x, res == nullptr ? nullptr : res + p0, n, kind, segment + first,
                 reinterpret_cast<float*>(segment + wire::round16(s)) + j);
    }
  });
}

}  // namespace
}  // namespace flatgrad

TORCH_LIBRARY_FRAGMENT(flatgrad, m) {
  // A plan's op (see [Note: plans] in docs/design.md): the tensors come
  // as its table of (address, dtype code) rows; `runs` is the layout's pack run
  // table. Eager only, as _pack_table: the schema cannot name what the addresses alias.
  // numel: the elements the runs cover (the layout's numel), so that no backend reads the runs on the host.
  m.def("_pack_quantize_table(Tensor table, Tensor runs, int numel, int world_size, int block, int kind, float scale, "
        "Tensor(a!) wire, Tensor(b!)? residual) -> ()");
}

TORCH_LIBRARY_IMPL(flatgrad, CPU, m) {
  m.impl("_pack_quantize_table", &flatgrad::pack_quantize_table_cpu);
}
