// The per-run element loop of the CUDA pack and unpack kernels.
//
// Everything here is __host__ __device__ and uses no block-level
// synchronisation: thread `tid` of `nthreads` touches a fixed set of
// elements, disjoint from every other thread's. A kernel calls it with
// tid = threadIdx.x; .ci/cuda_copy_host_check.cu calls it on the host for
// every tid in turn, which tests the index math (heads, vector bodies,
// tails, alignment choices, no element written twice or out of bounds)
// on machines without a GPU.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__CUDACC__)
#define FLATGRAD_HD __host__ __device__ __forceinline__
#else
#define FLATGRAD_HD inline
#endif

namespace flatgrad {
namespace cuda {

// Casts go through torch's own c10 types and multiply/add are never contracted
// into an FMA, so that the kernels give the reference's bits. See
// [Note: CUDA arithmetic] in docs/design.md.
FLATGRAD_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

FLATGRAD_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

FLATGRAD_HD bool is_finite(float f) {
#if defined(__CUDA_ARCH__)
  const uint32_t bits = __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
#endif
  return (bits & 0x7f800000u) != 0x7f800000u;
}

// What happens to one element: cast, optional scale, copy or accumulate,
// optional statistics of the value written. One object per thread; the
// statistics are that thread's partial sums.
template <typename in_t, typename out_t, bool kAccumulate, bool kStats>
struct ElementOp {
  static constexpr bool accumulate = kAccumulate;

  float scale;
  bool scaled;  // false when the call's scale == 1.0: no multiply at all
  float sum_sq = 0.0f;
  int64_t nonfinite = 0;

  FLATGRAD_HD ElementOp(float scale_, bool scaled_) : scale(scale_), scaled(scaled_) {}

  // `old` is the current value of the destination; read only when accumulating.
  FLATGRAD_HD out_t operator()(in_t x, out_t old) {
    out_t y;
    if constexpr (kAccumulate) {
      float v = static_cast<float>(x);
      if (scaled) {
        v = mul_rn(v, scale);
      }
      y = static_cast<out_t>(add_rn(static_cast<float>(old), v));
    } else if constexpr (std::is_same<in_t, out_t>::value) {
      y = scaled ? static_cast<out_t>(mul_rn(static_cast<float>(x), scale)) : x;
    } else {
      float v = static_cast<float>(x);
      if (scaled) {
        v = mul_rn(v, scale);
      }
      y = static_cast<out_t>(v);
    }
    if constexpr (kStats) {
      const float w = static_cast<float>(y);
      sum_sq = add_rn(sum_sq, mul_rn(w, w));
      nonfinite += is_finite(w) ? 0 : 1;
    }
    return y;
  }
};

// 16-byte aligned vector of N elements (N * sizeof(T) is 16 or 32 bytes). A
// load or store of one compiles to one or two 128-bit LDG/STG.
template <typename T, int N>
struct alignas(16) Vec {
  T v[N];
};

constexpr int64_t kVecBytes = 16;
// Vectors in flight per thread in the aligned path: with 256 threads and
// 8192-element runs that is the whole run in one or two passes, and 64+ bytes
// of loads in flight per thread, enough to cover HBM latency at full occupancy.
constexpr int kVecUnroll = 4;
// Elements in flight per thread in the scalar path (loads issued before any
// store; coalesced: consecutive threads touch consecutive elements).
constexpr int kScalarUnroll = 8;

// Elements per vector for an (in, out) pair: 16 bytes of the narrower type,
// so that the narrower side moves 16 bytes and the wider side 32 bytes (two
// 128-bit accesses) per vector.
template <typename in_t, typename out_t>
constexpr int kVecWidth = static_cast<int>(kVecBytes / (sizeof(in_t) < sizeof(out_t) ? sizeof(in_t) : sizeof(out_t)));

// Elements [begin, end): thread tid takes begin + tid, begin + tid + nthreads,
// ... (coalesced), kUnroll of them loaded before any is stored.
template <int kUnroll, typename in_t, typename out_t, typename Op>
FLATGRAD_HD void scalar_range(
    const in_t* __restrict__ src,
    out_t* __restrict__ dst,
    int64_t begin,
    int64_t end,
    int64_t tid,
    int64_t nthreads,
    Op& op) {
  for (int64_t base = begin + tid; base < end; base += nthreads * kUnroll) {
    in_t x[kUnroll];
    out_t old[kUnroll] = {};
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t i = base + j * nthreads;
      if (i < end) {
        x[j] = src[i];
        if constexpr (Op::accumulate) {
          old[j] = dst[i];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t i = base + j * nthreads;
      if (i < end) {
        dst[i] = op(x[j], old[j]);
      }
    }
  }
}

// Elements before the first 16-byte boundary of `dst` (all n when dst is not
// even element-aligned, which leaves everything to the scalar path).
template <typename T>
FLATGRAD_HD int64_t head_to_alignment(const T* dst, int64_t n) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(dst);
  if (address % sizeof(T) != 0) {
    return n;
  }
  const int64_t head = static_cast<int64_t>(((kVecBytes - static_cast<int64_t>(address % kVecBytes)) % kVecBytes) / static_cast<int64_t>(sizeof(T)));
  return head < n ? head : n;
}

// dst[i] = op(src[i], dst[i]) for i in [0, n), all threads of a block together.
//
// The alignment is decided per run at run time: a scalar head brings dst to
// a 16-byte boundary; if src is then 16-byte aligned too, the body moves
// 16-byte vectors on both sides and a scalar tail finishes. Otherwise (src
// and dst misaligned relative to each other, e.g. a flat layout whose tensor
// offsets are odd) the whole run takes the coalesced scalar path.
//
// Why not 16-byte stores fed by element loads in that case (what
// _chunk_cat's misaligned path does)? Thread t would load elements
// [t*V, t*V+V): one warp load instruction then spans 512 bytes for 64 useful
// ones, four L1 wavefronts instead of one. The coalesced scalar path keeps
// every access at one wavefront, and with kScalarUnroll elements in flight
// per thread at full occupancy it still has ~32 KB of loads in flight per SM,
// above the ~20 KB that ~4.8 TB/s at ~600 ns latency needs over 132 SMs.
// (Estimates, not measurements: bench/ decides on the H200.)
template <typename in_t, typename out_t, typename Op>
FLATGRAD_HD void copy_run(
    const in_t* __restrict__ src,
    out_t* __restrict__ dst,
    int64_t n,
    int64_t tid,
    int64_t nthreads,
    Op& op) {
  constexpr int kVec = kVecWidth<in_t, out_t>;
  using InVec = Vec<in_t, kVec>;
  using OutVec = Vec<out_t, kVec>;
  static_assert(sizeof(InVec) == kVec * sizeof(in_t) && sizeof(InVec) % kVecBytes == 0, "input vector layout");
  static_assert(sizeof(OutVec) == kVec * sizeof(out_t) && sizeof(OutVec) % kVecBytes == 0, "output vector layout");

  const int64_t head = head_to_alignment(dst, n);
  const uintptr_t src_body = reinterpret_cast<uintptr_t>(src) + static_cast<uintptr_t>(head) * sizeof(in_t);
  const int64_t nvec = (n - head) / kVec;
  if (nvec == 0 || src_body % kVecBytes != 0) {
    scalar_range<kScalarUnroll>(src, dst, 0, n, tid, nthreads, op);
    return;
  }
  scalar_range<1>(src, dst, 0, head, tid, nthreads, op);

  const InVec* vsrc = reinterpret_cast<const InVec*>(src + head);
  OutVec* vdst = reinterpret_cast<OutVec*>(dst + head);
  for (int64_t base = tid; base < nvec; base += nthreads * kVecUnroll) {
    InVec x[kVecUnroll];
    OutVec y[kVecUnroll] = {};
#pragma unroll
    for (int j = 0; j < kVecUnroll; ++j) {
      const int64_t k = base + j * nthreads;
      if (k < nvec) {
        x[j] = vsrc[k];
        if constexpr (Op::accumulate) {
          y[j] = vdst[k];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kVecUnroll; ++j) {
      const int64_t k = base + j * nthreads;
      if (k < nvec) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          y[j].v[e] = op(x[j].v[e], y[j].v[e]);
        }
        vdst[k] = y[j];
      }
    }
  }

  scalar_range<1>(src, dst, head + nvec * kVec, n, tid, nthreads, op);
}

// dst[0, n) = 0 (pack's padding), 16-byte stores between scalar head and tail.
template <typename out_t>
FLATGRAD_HD void zero_run(out_t* __restrict__ dst, int64_t n, int64_t tid, int64_t nthreads) {
  constexpr int kVec = static_cast<int>(kVecBytes / sizeof(out_t));
  using OutVec = Vec<out_t, kVec>;
  const out_t zero{};  // value-initialised: all bits zero, i.e. +0.0 in every dtype
  const int64_t head = head_to_alignment(dst, n);
  const int64_t nvec = (n - head) / kVec;
  for (int64_t i = tid; i < head; i += nthreads) {
    dst[i] = zero;
  }
  OutVec* vdst = reinterpret_cast<OutVec*>(dst + head);
  const OutVec zeros = {};
  for (int64_t k = tid; k < nvec; k += nthreads) {
    vdst[k] = zeros;
  }
  for (int64_t i = head + nvec * kVec + tid; i < n; i += nthreads) {
    dst[i] = zero;
  }
}

}  // namespace cuda
}  // namespace flatgrad
