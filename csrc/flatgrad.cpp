// flatgrad's compiled ops: the schemas (declared once, here) and the CPU kernels.
//
// pack:   buffer[runs] <- cast(scale * tensors[...]), padding zero, in one pass;
//         a missing tensor (None, or address 0 in a plan's table) packs as zeros.
// unpack: outs[runs]   <- cast(scale * shard[...]) or outs + scale * shard, plus
//         optional stats [sum_sq, nonfinite_count] of the values written.
//
// Arithmetic is the reference's, bit for bit (see [Note: arithmetic contract]
// in flatgrad/kernels/reference.py): casts are c10's round-to-nearest-even
// through fp32, a scale != 1 multiplies in fp32, an accumulate adds in fp32 and
// rounds once. setup.py passes -ffp-contract=off so no multiply-add is fused.
// NaN payloads are not part of the contract (torch's own vector and scalar
// paths disagree on them); a NaN stays a NaN.
//
// Work is balanced by element ranges, not by runs: run tables are read as
// sorted, contiguous intervals and every thread binary-searches the first run
// of its range (see [Note: run tables] in docs/design.md).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "flatgrad/runs.h"

namespace flatgrad {
namespace {

// Elements per unit of parallel work (and per stats partial sum). 32K elements
// is 64-128 KiB: large enough that a task's overhead is noise, small enough
// that two cores split a 1M-element bucket evenly.
constexpr int64_t kGrain = 32768;

// Independent accumulator lanes of the stats sums, so that the sum loop
// vectorises without reassociation (which -O3 alone never does for floats).
constexpr int kLanes = 8;

// The element loops are compiled twice, for AVX2 and for the x86-64 baseline,
// and the loader picks one per CPU. No FMA is enabled, so both compute the same.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FLATGRAD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FLATGRAD_CLONES
#endif

// ---------------------------------------------------------------------------
// Element I/O: each dtype as raw bits, loaded to and stored from fp32 with
// c10's conversions or bit-identical branch-free ones, so that gcc vectorises
// the loops around them.

template <typename T>
struct Io;

template <>
struct Io<float> {
  using Raw = float;
  static inline float load(Raw x) { return x; }
  static inline Raw store(float x) { return x; }
};

template <>
struct Io<c10::BFloat16> {
  using Raw = uint16_t;
  static inline float load(Raw x) { return c10::bit_cast<float>(static_cast<uint32_t>(x) << 16); }
  static inline Raw store(float x) { return c10::detail::round_to_nearest_even(x); }
};

// fp16 <-> fp32 written out branch-free (c10's own fp32 -> fp16 is not inlined,
// which stops vectorisation). Bit-identical to c10's software conversions for
// every input, NaN included (checked exhaustively when this was written).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t magnitude = h & 0x7FFFu;
  // Normal, inf and NaN: move the exponent and mantissa into place and
  // rebias the exponent (15 -> 127); inf/NaN need an all-ones exponent, and
  // a NaN comes out quiet.
  uint32_t bits = (magnitude << 13) + (UINT32_C(112) << 23);
  bits = magnitude >= 0x7C00u ? bits + (UINT32_C(112) << 23) : bits;
  bits = magnitude > 0x7C00u ? bits | UINT32_C(0x00400000) : bits;
  // Subnormal (and zero): the mantissa counts units of 2^-24, exactly.
  const float subnormal = static_cast<float>(magnitude) * 0x1.0p-24f;
  const uint32_t result = magnitude < 0x0400u ? c10::bit_cast<uint32_t>(subnormal) : bits;
  return c10::bit_cast<float>(sign | result);
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t w = c10::bit_cast<uint32_t>(f);
  const uint32_t sign = (w >> 16) & 0x8000u;
  const uint32_t a = w & UINT32_C(0x7FFFFFFF);
  // |f| >= 2^-14: rebias the exponent (127 -> 15) and round the 13 dropped
  // mantissa bits to nearest even; a carry correctly bumps the exponent.
  const uint32_t normal = (a - (UINT32_C(112) << 23) + UINT32_C(0x0FFF) + ((a >> 13) & 1u)) >> 13;
  // |f| < 2^-14: adding 0.5 (ulp 2^-24, the fp16 subnormal step) makes the
  // FPU round to nearest even; the low mantissa bits are the fp16 bits.
  const uint32_t subnormal = c10::bit_cast<uint32_t>(c10::bit_cast<float>(a) + 0.5f) - UINT32_C(0x3F000000);
  uint32_t h = a < UINT32_C(0x38800000) ? subnormal : normal;
  h = a >= UINT32_C(0x477FF000) ? 0x7C00u : h;  // rounds to inf (65520 and above)
  h = a > UINT32_C(0x7F800000) ? 0x7E00u : h;   // NaN
  return static_cast<uint16_t>(sign | h);
}

template <>
struct Io<c10::Half> {
  using Raw = uint16_t;
  static inline float load(Raw x) { return f16_to_f32(x); }
  static inline Raw store(float x) { return f32_to_f16(x); }
};

inline bool nonfinite(float x) {
  return (c10::bit_cast<uint32_t>(x) & UINT32_C(0x7F800000)) == UINT32_C(0x7F800000);
}

// Calls f(T{}) with T the C++ type of a supported dtype.
template <typename F>
inline void dispatch_dtype(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat:
      return f(float{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    case at::kHalf:
      return f(c10::Half{});
    default:
      TORCH_INTERNAL_ASSERT(false, "flatgrad: unsupported dtype ", t);  // checked before dispatch
  }
}

// Checks a tensor argument once per call; `index` >= 0 names a list element.
void check_dense(const at::Tensor& t, const char* op, const char* name, int64_t index = -1) {
  const std::string label = index >= 0 ? std::string(name) + "[" + std::to_string(index) + "]" : std::string(name);
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", label, " must be a dense (strided) tensor, got ", t.layout());
  TORCH_CHECK(t.device().is_cpu(), op, ": ", label, " must be on CPU, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", label, " must be contiguous");
  const auto d = t.scalar_type();
  TORCH_CHECK(d == at::kFloat || d == at::kBFloat16 || d == at::kHalf, op, ": ", label, " has dtype ", d,
              "; supported: Float, BFloat16, Half");
}

void check_runs(const at::Tensor& runs, int64_t width, const char* op) {
  TORCH_CHECK(runs.scalar_type() == at::kLong, op, ": runs must be int64, got ", runs.scalar_type());
  TORCH_CHECK(runs.dim() == 2 && runs.size(1) == width, op, ": runs must have shape [R, ", width, "], got ",
              runs.sizes());
  TORCH_CHECK(runs.device().is_cpu(), op, ": runs must be on CPU, got ", runs.device());
  TORCH_CHECK(runs.is_contiguous(), op, ": runs must be contiguous");
}

// ---------------------------------------------------------------------------
// Element loops

// dst[i] = cast(scale * src[i]), or with kAccumulate cast(float(dst[i]) + scale * src[i]);
// kScaled is scale != 1 (with scale == 1 a value is cast without a multiply).
template <typename in_t, typename out_t, bool kScaled, bool kAccumulate>
inline typename Io<out_t>::Raw cast_one(typename Io<in_t>::Raw x, typename Io<out_t>::Raw old, float scale) {
  float v = Io<in_t>::load(x);
  if constexpr (kScaled) {
    v = v * scale;
  }
  if constexpr (kAccumulate) {
    v = Io<out_t>::load(old) + v;
  }
  return Io<out_t>::store(v);
}

template <typename in_t, typename out_t, bool kScaled, bool kAccumulate>
FLATGRAD_CLONES void cast_span(const void* src, void* dst, int64_t n, float scale) {
  const auto* __restrict__ s = static_cast<const typename Io<in_t>::Raw*>(src);
  auto* __restrict__ d = static_cast<typename Io<out_t>::Raw*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    d[i] = cast_one<in_t, out_t, kScaled, kAccumulate>(s[i], d[i], scale);
  }
}

// ---------------------------------------------------------------------------
// pack

// Copies n elements, with cast and scale (`scaled` means scale != 1: with
// scale == 1 a value is cast directly, and a same-dtype copy is a memcpy).
void copy_span(const void* src, at::ScalarType in, void* dst, at::ScalarType out, int64_t n, bool scaled,
               float scale) {
  if (n <= 0) {
    return;
  }
  if (!scaled && in == out) {
    std::memcpy(dst, src, n * c10::elementSize(out));
    return;
  }
  dispatch_dtype(in, [&](auto in_v) {
    dispatch_dtype(out, [&](auto out_v) {
      using in_t = decltype(in_v);
      using out_t = decltype(out_v);
      if (scaled) {
        cast_span<in_t, out_t, true, false>(src, dst, n, scale);
      } else {
        cast_span<in_t, out_t, false, false>(src, dst, n, scale);
      }
    });
  });
}

// A pack input: data == nullptr means "no source" (its range is written as zeros).
struct Source {
  const char* data;
  at::ScalarType dtype;
  int64_t itemsize;
};

void check_table(const at::Tensor& table, const char* op) {
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == table_col::kWidth, op,
              ": table must be int64 of shape [T, ", table_col::kWidth, "], got ", table.scalar_type(), " ",
              table.sizes());
  TORCH_CHECK(table.device().is_cpu() && table.is_contiguous(), op, ": table must be a contiguous CPU tensor");
}

// The entries of a tensor table (made and checked by a plan) as typed pointers.
template <typename Entry>
std::vector<Entry> table_entries(const at::Tensor& table, const char* op) {
  check_table(table, op);
  std::vector<Entry> entries;
  entries.reserve(table.size(0));
  const int64_t* row = table.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < table.size(0); ++i, row += table_col::kWidth) {
    const int64_t code = row[table_col::kCode];
    TORCH_CHECK(row[table_col::kAddress] == 0 || (code >= kCodeFloat && code <= kCodeHalf), op, ": table[", i,
                "] has dtype code ", code);
    const at::ScalarType dtype = code_dtype(code);
    entries.push_back({reinterpret_cast<decltype(Entry::data)>(row[table_col::kAddress]), dtype,
                       static_cast<int64_t>(c10::elementSize(dtype))});
  }
  return entries;
}

// Fills `out` from `sources` along the pack run table. `numels` (one per
// source, -1 for a missing one) bounds every read; empty when a plan has
// already matched the tensors to the layout.
void pack_sources(const std::vector<Source>& sources, const std::vector<int64_t>& numels, const at::Tensor& runs,
                  const at::Tensor& out, double scale, const char* op) {
  using namespace pack_col;
  check_runs(runs, kWidth, op);
  check_dense(out, op, "out");
  const int64_t num_tensors = static_cast<int64_t>(sources.size());

  // One pass over the table: the runs must tile `out` in order, and every
  // run must read inside its tensor. start[k] is run k's first element.
  const int64_t num_runs = runs.size(0);
  const int64_t* table = runs.const_data_ptr<int64_t>();
  std::vector<int64_t> start(num_runs + 1);
  int64_t total = 0;
  for (int64_t k = 0; k < num_runs; ++k) {
    const int64_t* r = table + k * kWidth;
    TORCH_CHECK(r[kDstOffset] == total, op, ": runs[", k, "] starts at ", r[kDstOffset], ", expected ", total,
                " (pack runs must tile out in order)");
    TORCH_CHECK(r[kLength] >= 0 && r[kValid] >= 0 && r[kValid] <= r[kLength], op, ": runs[", k,
                "] has length ", r[kLength], " and valid ", r[kValid]);
    const int64_t t = r[kTensorIndex];
    TORCH_CHECK(t >= -1 && t < num_tensors, op, ": runs[", k, "] reads tensors[", t, "], but ", num_tensors,
                " tensors were given");
    if (r[kValid] > 0) {
      TORCH_CHECK(t >= 0, op, ": runs[", k, "] has valid ", r[kValid], " but no tensor");
      if (!numels.empty() && numels[t] >= 0) {
        TORCH_CHECK(r[kSrcOffset] >= 0 && r[kSrcOffset] + r[kValid] <= numels[t], op, ": runs[", k, "] reads [",
                    r[kSrcOffset], ", ", r[kSrcOffset] + r[kValid], ") of tensors[", t, "], which has ", numels[t],
                    " elements");
      }
    }
    start[k] = total;
    total += r[kLength];
  }
  start[num_runs] = total;
  TORCH_CHECK(total == out.numel(), op, ": runs cover ", total, " elements, out has ", out.numel());

  const bool scaled = scale != 1.0;
  const auto fscale = static_cast<float>(scale);
  const at::ScalarType out_dtype = out.scalar_type();
  const int64_t out_size = static_cast<int64_t>(out.element_size());
  char* out_data = static_cast<char*>(out.data_ptr());

  at::parallel_for(0, total, kGrain, [&](int64_t begin, int64_t end) {
    walk_pack_runs(
        start, table, begin, end, [&](int64_t t) { return sources[t].data != nullptr; },
        [&](int64_t t, int64_t src, int64_t pos, int64_t n) {
          const Source& s = sources[t];
          copy_span(s.data + src * s.itemsize, s.dtype, out_data + pos * out_size, out_dtype, n, scaled, fscale);
        },
        // padding or a missing tensor: all-zero bits are +0.0 in every dtype
        [&](int64_t pos, int64_t n) { std::memset(out_data + pos * out_size, 0, n * out_size); });
  });
}

void pack_cpu(const c10::List<std::optional<at::Tensor>>& tensors, const at::Tensor& runs, const at::Tensor& out,
              double scale) {
  constexpr const char* op = "flatgrad::pack";
  const int64_t num_tensors = static_cast<int64_t>(tensors.size());
  std::vector<Source> sources;
  std::vector<int64_t> numels;
  sources.reserve(num_tensors);
  numels.reserve(num_tensors);
  for (int64_t i = 0; i < num_tensors; ++i) {
    const std::optional<at::Tensor> t = tensors[i];
    if (!t.has_value()) {
      sources.push_back({nullptr, at::kFloat, 0});
      numels.push_back(-1);
      continue;
    }
    check_dense(*t, op, "tensors", i);
    sources.push_back({static_cast<const char*>(t->const_data_ptr()), t->scalar_type(),
                       static_cast<int64_t>(t->element_size())});
    numels.push_back(t->numel());
  }
  pack_sources(sources, numels, runs, out, scale, op);
}

void pack_table_cpu(const at::Tensor& table, const at::Tensor& runs, const at::Tensor& out, double scale) {
  constexpr const char* op = "flatgrad::_pack_table";
  pack_sources(table_entries<Source>(table, op), {}, runs, out, scale, op);
}

// ---------------------------------------------------------------------------
// unpack

struct Partial {
  double sum_sq = 0.0;
  int64_t nonfinite = 0;
};

// Adds the stats of n values as written (read back from out, still in cache:
// a span is at most kGrain elements), summed in double over fixed lanes, so
// the result depends only on the run table.
template <typename out_t>
FLATGRAD_CLONES void add_stats(const void* dst, int64_t n, Partial& partial) {
  const auto* __restrict__ d = static_cast<const typename Io<out_t>::Raw*>(dst);
  double sum[kLanes] = {};
  int64_t bad[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float w = Io<out_t>::load(d[i + j]);
      sum[j] += static_cast<double>(w) * static_cast<double>(w);
      bad[j] += nonfinite(w);
    }
  }
  for (int j = 0; i < n; ++i, ++j) {
    const float w = Io<out_t>::load(d[i]);
    sum[j] += static_cast<double>(w) * static_cast<double>(w);
    bad[j] += nonfinite(w);
  }
  for (int j = 0; j < kLanes; ++j) {
    partial.sum_sq += sum[j];
    partial.nonfinite += bad[j];
  }
}

struct UnpackArgs {
  bool scaled;
  bool accumulate;
  bool stats;
  float scale;
};

void unpack_segment(const void* src, at::ScalarType in, void* dst, at::ScalarType out, int64_t n,
                    const UnpackArgs& a, Partial& partial) {
  if (n <= 0) {
    return;
  }
  if (!a.scaled && !a.accumulate && in == out) {
    std::memcpy(dst, src, n * c10::elementSize(out));
  } else {
    dispatch_dtype(in, [&](auto in_v) {
      dispatch_dtype(out, [&](auto out_v) {
        using in_t = decltype(in_v);
        using out_t = decltype(out_v);
        // One branch-free loop per flag combination.
        if (a.scaled) {
          a.accumulate ? cast_span<in_t, out_t, true, true>(src, dst, n, a.scale)
                       : cast_span<in_t, out_t, true, false>(src, dst, n, a.scale);
        } else {
          a.accumulate ? cast_span<in_t, out_t, false, true>(src, dst, n, a.scale)
                       : cast_span<in_t, out_t, false, false>(src, dst, n, a.scale);
        }
      });
    });
  }
  if (a.stats) {
    dispatch_dtype(out, [&](auto out_v) { add_stats<decltype(out_v)>(dst, n, partial); });
  }
}

struct Target {
  char* data;
  at::ScalarType dtype;
  int64_t itemsize;
};

// Writes `shard` into `targets` along the unpack run table. `numels` (one
// per target) bounds every write; empty when a plan has already matched the
// outputs to the layout.
at::Tensor unpack_targets(const at::Tensor& shard, const at::Tensor& runs, const std::vector<Target>& targets,
                          const std::vector<int64_t>& numels, double scale, bool accumulate, bool stats,
                          const char* op) {
  using namespace unpack_col;
  check_runs(runs, kWidth, op);
  check_dense(shard, op, "shard");
  const int64_t num_outs = static_cast<int64_t>(targets.size());

  // One pass over the table: every run must stay inside shard and its out.
  // Work is numbered by the concatenation of the runs: start[k] is run k's
  // first work element.
  const int64_t num_runs = runs.size(0);
  const int64_t* table = runs.const_data_ptr<int64_t>();
  std::vector<int64_t> start(num_runs + 1);
  int64_t total = 0;
  for (int64_t k = 0; k < num_runs; ++k) {
    const int64_t* r = table + k * kWidth;
    const int64_t o = r[kOutIndex];
    TORCH_CHECK(r[kLength] >= 0, op, ": runs[", k, "] has length ", r[kLength]);
    TORCH_CHECK(o >= 0 && o < num_outs, op, ": runs[", k, "] writes outs[", o, "], but ", num_outs,
                " outs were given");
    TORCH_CHECK(r[kSrcOffset] >= 0 && r[kSrcOffset] + r[kLength] <= shard.numel(), op, ": runs[", k, "] reads [",
                r[kSrcOffset], ", ", r[kSrcOffset] + r[kLength], ") of shard, which has ", shard.numel(),
                " elements");
    if (!numels.empty()) {
      TORCH_CHECK(r[kOutOffset] >= 0 && r[kOutOffset] + r[kLength] <= numels[o], op, ": runs[", k, "] writes [",
                  r[kOutOffset], ", ", r[kOutOffset] + r[kLength], ") of outs[", o, "], which has ", numels[o],
                  " elements");
    }
    start[k] = total;
    total += r[kLength];
  }
  start[num_runs] = total;

  const UnpackArgs args{scale != 1.0, accumulate, stats, static_cast<float>(scale)};
  const auto* shard_data = static_cast<const char*>(shard.const_data_ptr());
  const at::ScalarType shard_dtype = shard.scalar_type();
  const int64_t shard_size = static_cast<int64_t>(shard.element_size());

  // Fixed chunks of kGrain work elements, one partial each, summed in chunk
  // order below: the stats do not depend on the number of threads.
  const int64_t num_chunks = (total + kGrain - 1) / kGrain;
  std::vector<Partial> partials(stats ? num_chunks : 0);
  at::parallel_for(0, num_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    Partial scratch;
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      Partial& partial = stats ? partials[c] : scratch;
      const int64_t end = std::min(total, (c + 1) * kGrain);
      for (int64_t k = find_run(start, c * kGrain), pos = c * kGrain; pos < end; ++k) {
        const int64_t* r = table + k * kWidth;
        const int64_t run_end = std::min(end, start[k + 1]);
        if (pos < run_end) {
          const Target& t = targets[r[kOutIndex]];
          const int64_t delta = pos - start[k];
          unpack_segment(shard_data + (r[kSrcOffset] + delta) * shard_size, shard_dtype,
                         t.data + (r[kOutOffset] + delta) * t.itemsize, t.dtype, run_end - pos, args, partial);
          pos = run_end;
        }
      }
    }
  });

  if (!stats) {
    return at::empty({0}, shard.options().dtype(at::kFloat));
  }
  Partial sum;
  for (const Partial& p : partials) {
    sum.sum_sq += p.sum_sq;
    sum.nonfinite += p.nonfinite;
  }
  at::Tensor result = at::empty({2}, shard.options().dtype(at::kFloat));
  float* res = result.data_ptr<float>();
  res[0] = static_cast<float>(sum.sum_sq);
  res[1] = static_cast<float>(sum.nonfinite);
  return result;
}

at::Tensor unpack_cpu(const at::Tensor& shard, const at::Tensor& runs, at::TensorList outs, double scale,
                      bool accumulate, bool stats) {
  constexpr const char* op = "flatgrad::unpack";
  const int64_t num_outs = static_cast<int64_t>(outs.size());
  std::vector<Target> targets;
  std::vector<int64_t> numels;
  targets.reserve(num_outs);
  numels.reserve(num_outs);
  for (int64_t i = 0; i < num_outs; ++i) {
    check_dense(outs[i], op, "outs", i);
    targets.push_back({static_cast<char*>(outs[i].data_ptr()), outs[i].scalar_type(),
                       static_cast<int64_t>(outs[i].element_size())});
    numels.push_back(outs[i].numel());
  }
  return unpack_targets(shard, runs, targets, numels, scale, accumulate, stats, op);
}

at::Tensor unpack_table_cpu(const at::Tensor& shard, const at::Tensor& runs, const at::Tensor& table,
                            at::ScalarType out_dtype, double scale, bool accumulate, bool stats) {
  constexpr const char* op = "flatgrad::_unpack_table";
  std::vector<Target> targets = table_entries<Target>(table, op);
  for (size_t i = 0; i < targets.size(); ++i) {
    TORCH_CHECK(targets[i].data == nullptr || targets[i].dtype == out_dtype, op, ": table[", i,
                "] must hold an output of dtype ", out_dtype);
  }
  return unpack_targets(shard, runs, targets, {}, scale, accumulate, stats, op);
}

}  // namespace

TORCH_LIBRARY(flatgrad, m) {
  // Fake (meta) implementations live in Python, for torch.compile.
  m.set_python_module("flatgrad.kernels.compiled");
  m.def("pack(Tensor?[] tensors, Tensor runs, Tensor(a!) out, float scale) -> ()");
  m.def("unpack(Tensor shard, Tensor runs, Tensor(a!)[] outs, float scale, bool accumulate, bool stats) -> Tensor");
  // The plans' ops (see [Note: plans] in docs/design.md): the tensors
  // come as a table of (address, dtype code) rows on the op's device, made,
  // checked and kept alive by a PackPlan / UnpackPlan, so a call converts no
  // tensor list. Eager only: the schema cannot name what the addresses alias.
  m.def("_pack_table(Tensor table, Tensor runs, Tensor(a!) out, float scale) -> ()");
  m.def("_unpack_table(Tensor shard, Tensor runs, Tensor table, ScalarType out_dtype, float scale, bool accumulate, "
        "bool stats) -> Tensor");
}

TORCH_LIBRARY_IMPL(flatgrad, CPU, m) {
  m.impl("pack", &pack_cpu);
  m.impl("unpack", &unpack_cpu);
  m.impl("_pack_table", &pack_table_cpu);
  m.impl("_unpack_table", &unpack_table_cpu);
}

}  // namespace flatgrad
