// Host-side check of the CUDA element loop (csrc/include/flatgrad/cuda_copy.cuh).
//
// The kernels call copy_run / zero_run with tid = threadIdx.x; here every tid
// of a 256-thread block is run in turn on host memory. That checks what can be
// checked without a GPU: every element of a run is written exactly once, no
// byte outside the run is touched, values equal a plain element-by-element
// loop, and the per-thread statistics add up, for every dtype pair, every
// misalignment of src and dst (so both the 16-byte vector path and the scalar
// fallback run), lengths around the vector and unroll boundaries, and
// copy / scale / accumulate / stats. The arithmetic itself is the device's
// (__fmul_rn etc.) only on a GPU; tests/test_kernels.py checks that there.
//
// Built and run by .ci/build_cuda.sh (nvcc, host code only).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "flatgrad/cuda_copy.cuh"

namespace {

using flatgrad::cuda::copy_run;
using flatgrad::cuda::ElementOp;
using flatgrad::cuda::zero_run;

constexpr int64_t kThreads = 256;
constexpr int64_t kGuard = 64;  // bytes of sentinel before and after every run
constexpr unsigned char kSentinel = 0xA5;

int failures = 0;

#define CHECK(cond, ...)                    \
  do {                                      \
    if (!(cond)) {                          \
      if (++failures <= 20) {               \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
        std::printf(__VA_ARGS__);           \
        std::printf("\n");                  \
      }                                     \
    }                                       \
  } while (0)

template <typename T>
const char* name();
template <>
const char* name<float>() { return "f32"; }
template <>
const char* name<c10::BFloat16>() { return "bf16"; }
template <>
const char* name<c10::Half>() { return "f16"; }

// A 16-byte aligned byte arena; `at(offset)` is a T* at byte offset `offset`.
struct Arena {
  std::vector<unsigned char> bytes;
  unsigned char* base;
  explicit Arena(size_t n) : bytes(n + 64) {
    uintptr_t p = reinterpret_cast<uintptr_t>(bytes.data());
    base = bytes.data() + ((32 - p % 32) % 32);
  }
};

// Small integers, exact in every dtype, that differ between nearby elements
// (so an element copied from or to the wrong place is seen).
float value_of(int64_t i) {
  return static_cast<float>((i * 37) % 251 - 125);
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }
template <typename T>
bool same_bits(T a, T b) { return std::memcmp(&a, &b, sizeof(T)) == 0; }

template <typename in_t, typename out_t, bool kAccumulate, bool kStats>
void check_copy(int64_t n, int64_t src_shift, int64_t dst_shift, float scale, bool scaled) {
  Arena src_arena(kGuard * 2 + (n + 16) * sizeof(in_t));
  Arena dst_arena(kGuard * 2 + (n + 16) * sizeof(out_t));
  std::memset(src_arena.base, kSentinel, src_arena.bytes.size() - 64);
  std::memset(dst_arena.base, kSentinel, dst_arena.bytes.size() - 64);
  in_t* src = reinterpret_cast<in_t*>(src_arena.base + kGuard) + src_shift;
  out_t* dst = reinterpret_cast<out_t*>(dst_arena.base + kGuard) + dst_shift;
  std::vector<out_t> before(n);
  for (int64_t i = 0; i < n; ++i) {
    src[i] = static_cast<in_t>(value_of(i));
    dst[i] = static_cast<out_t>(value_of(i + 101) + 0.5f);
    before[i] = dst[i];
  }
  // Expected values: the same ElementOp applied by one plain loop.
  ElementOp<in_t, out_t, kAccumulate, kStats> ref_op(scale, scaled);
  std::vector<out_t> expected(n);
  for (int64_t i = 0; i < n; ++i) {
    expected[i] = ref_op(src[i], before[i]);
  }
  // The kernel's view: every thread of one block, in turn.
  int64_t nonfinite = 0;
  double sum_sq_total = 0.0;
  for (int64_t tid = 0; tid < kThreads; ++tid) {
    ElementOp<in_t, out_t, kAccumulate, kStats> op(scale, scaled);
    copy_run(src, dst, n, tid, kThreads, op);
    sum_sq_total += op.sum_sq;
    nonfinite += op.nonfinite;
  }
  for (int64_t i = 0; i < n; ++i) {
    CHECK(same_bits(dst[i], expected[i]), "%s->%s acc=%d n=%lld shifts=(%lld,%lld) element %lld: got %f want %f",
          name<in_t>(), name<out_t>(), kAccumulate, (long long)n, (long long)src_shift, (long long)dst_shift,
          (long long)i, static_cast<float>(dst[i]), static_cast<float>(expected[i]));
  }
  // Nothing outside [dst, dst + n) was written; src was never written.
  const unsigned char* dst_begin = reinterpret_cast<const unsigned char*>(dst);
  const unsigned char* dst_end = reinterpret_cast<const unsigned char*>(dst + n);
  for (const unsigned char* p = dst_arena.base; p < dst_arena.base + dst_arena.bytes.size() - 64; ++p) {
    if (p < dst_begin || p >= dst_end) {
      CHECK(*p == kSentinel, "%s->%s n=%lld shifts=(%lld,%lld): byte %lld outside the run was written",
            name<in_t>(), name<out_t>(), (long long)n, (long long)src_shift, (long long)dst_shift,
            (long long)(p - dst_begin));
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    CHECK(same_bits(src[i], static_cast<in_t>(value_of(i))), "src element %lld changed", (long long)i);
  }
  if (kStats) {
    double want = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const double w = static_cast<float>(expected[i]);
      want += w * w;
    }
    CHECK(std::fabs(sum_sq_total - want) <= 1e-5 * (want + 1.0), "stats sum_sq %f, want %f", sum_sq_total, want);
    CHECK(nonfinite == 0, "stats nonfinite %lld, want 0", (long long)nonfinite);
  }
}

// Every element is visited exactly once: accumulate 1 into 0 and expect 1
// everywhere (a skipped element stays 0, a doubled one becomes 2).
template <typename in_t, typename out_t>
void check_coverage(int64_t n, int64_t src_shift, int64_t dst_shift) {
  Arena src_arena((n + 16) * sizeof(in_t));
  Arena dst_arena((n + 16) * sizeof(out_t));
  in_t* src = reinterpret_cast<in_t*>(src_arena.base) + src_shift;
  out_t* dst = reinterpret_cast<out_t*>(dst_arena.base) + dst_shift;
  for (int64_t i = 0; i < n; ++i) {
    src[i] = static_cast<in_t>(1.0f);
    dst[i] = static_cast<out_t>(0.0f);
  }
  for (int64_t tid = 0; tid < kThreads; ++tid) {
    ElementOp<in_t, out_t, true, false> op(1.0f, false);
    copy_run(src, dst, n, tid, kThreads, op);
  }
  for (int64_t i = 0; i < n; ++i) {
    CHECK(static_cast<float>(dst[i]) == 1.0f, "%s->%s n=%lld shifts=(%lld,%lld): element %lld visited %g times",
          name<in_t>(), name<out_t>(), (long long)n, (long long)src_shift, (long long)dst_shift, (long long)i,
          static_cast<float>(dst[i]));
  }
}

template <typename out_t>
void check_zero(int64_t n, int64_t dst_shift) {
  Arena arena(kGuard * 2 + (n + 16) * sizeof(out_t));
  std::memset(arena.base, kSentinel, arena.bytes.size() - 64);
  out_t* dst = reinterpret_cast<out_t*>(arena.base + kGuard) + dst_shift;
  for (int64_t tid = 0; tid < kThreads; ++tid) {
    zero_run(dst, n, tid, kThreads);
  }
  const unsigned char* begin = reinterpret_cast<const unsigned char*>(dst);
  const unsigned char* end = reinterpret_cast<const unsigned char*>(dst + n);
  for (const unsigned char* p = arena.base; p < arena.base + arena.bytes.size() - 64; ++p) {
    const bool inside = p >= begin && p < end;
    CHECK(*p == (inside ? 0 : kSentinel), "zero_run<%s> n=%lld shift=%lld: byte %lld is %d", name<out_t>(),
          (long long)n, (long long)dst_shift, (long long)(p - begin), *p);
  }
}

// Lengths around 0, the vector widths, the unrolled pass sizes and a split run.
const int64_t kLengths[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 255, 256, 257, 1023, 1024, 1025,
                            2047, 2048, 2049, 4095, 4097, 8191, 8192, 8200, 20011};

template <typename in_t, typename out_t>
void check_pair() {
  for (int64_t n : kLengths) {
    for (int64_t s = 0; s < 8; ++s) {
      for (int64_t d = 0; d < 8; ++d) {
        check_copy<in_t, out_t, false, false>(n, s, d, 1.0f, false);
        check_copy<in_t, out_t, false, true>(n, s, d, 0.5f, true);
        check_copy<in_t, out_t, true, false>(n, s, d, 1.0f, false);
        check_copy<in_t, out_t, true, true>(n, s, d, 0.25f, true);
        check_coverage<in_t, out_t>(n, s, d);
      }
    }
  }
}

template <typename in_t>
void check_from() {
  check_pair<in_t, float>();
  check_pair<in_t, c10::BFloat16>();
  check_pair<in_t, c10::Half>();
}

// Same-dtype copies without scale must move bits (NaN payloads included).
void check_nan_payload() {
  const uint16_t payload = 0x7f81;  // a bf16 NaN that fp32 rounding would canonicalise
  c10::BFloat16 in;
  std::memcpy(&in, &payload, 2);
  ElementOp<c10::BFloat16, c10::BFloat16, false, false> op(1.0f, false);
  const c10::BFloat16 out = op(in, c10::BFloat16(0.0f));
  CHECK(same_bits(in, out), "bf16 -> bf16 unscaled copy changed a NaN payload");
  ElementOp<float, float, false, true> stats(1.0f, false);
  stats(INFINITY, 0.0f);
  stats(NAN, 0.0f);
  stats(2.0f, 0.0f);
  CHECK(stats.nonfinite == 2, "nonfinite count %lld, want 2", (long long)stats.nonfinite);
}

}  // namespace

int main() {
  check_from<float>();
  check_from<c10::BFloat16>();
  check_from<c10::Half>();
  for (int64_t n : kLengths) {
    for (int64_t d = 0; d < 8; ++d) {
      check_zero<float>(n, d);
      check_zero<c10::BFloat16>(n, d);
      check_zero<c10::Half>(n, d);
    }
  }
  check_nan_payload();
  if (failures != 0) {
    std::printf("cuda_copy host check: %d failures\n", failures);
    return 1;
  }
  std::printf("cuda_copy host check: ok\n");
  return 0;
}
