// Batch-invariant CPU kernels for dspark_hf's "exact" kernel mode (see dspark_hf/kernels/ops.py).
//
// Every output element is computed by one fixed sequence of floating-point operations that depends only on
// the inputs of its own row (and, for attention, on the keys that row may see), never on how many rows are
// in the call, how they are tiled, or how many threads run. So row i of a k-row call is bit-identical to the
// same row computed in a 1-row call: a k-token verification forward equals k one-token decoding steps.
//
//  * linear: out[m, n] = fma chain over k = 0 .. K-1 of x[m, k] * w[n, k] (+ bias[n]): ONE sequential chain per
//    output element, the weights packed once into panels of columns so that a register-blocked micro-kernel (up
//    to 8 rows x 48 columns with AVX-512) runs many chains side by side. Tiling, the row count, the thread count
//    and the ISA change which chains run together, never the operations of one (the packed GEMM below).
//    linear_bf16 (and attn_in_bf16 / attn_out_bf16): the same with x and w rounded to bfloat16, one chain of
//    vdpbf16ps steps over the k pairs per element (the bf16 GEMM below), bit-identical on its portable kernel.
//  * attention: per (batch, head, query) the scores of the visible keys (a dot product over D as 16 lane chains of
//    fmas, then a fixed tree over the 16 lanes), their maximum, exp(s - max) by a fixed polynomial of our own
//    (exp_weight: one sequence of operations per element, vectorised or not), the denominator summed over visible
//    keys in ascending order, and the weighted sum of values accumulated key by key in ascending order. Keys a
//    query may not see are skipped, so a query that sees the first L keys gets the same result whether the cache
//    holds L or more, and whatever other queries share the call: a prefill of any length, in one call or in
//    chunks, computes each query as decoding does. Queries that share a key/value head (GQA heads and up to four
//    positions) share the loads of the keys (16 at a time, widened once) and of the values; the units are split over
//    the threads by their cost. attention_segments: the same per query for packed rows of
//    many sequences, each over its own KV slot (the engine's unpadded forwards).
//
//  * rms_norm, rope, silu_mul: the per-row steps of a decoder layer, for the exact mode's lean layer path.
//
// Compiled with -ffp-contract=off so that the compiler never fuses or reorders anything behind our back.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DSPARK_AVX2 1
#endif

namespace {

#ifdef DSPARK_AVX2
using vec8 = __m256;
inline vec8 vzero() { return _mm256_setzero_ps(); }
inline vec8 vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec8 vfma(vec8 a, vec8 b, vec8 c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, vec8 a) { _mm256_storeu_ps(p, a); }
#else
struct vec8 {
  float v[8];
};
inline vec8 vzero() {
  vec8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = 0.f;
  return r;
}
inline vec8 vload(const float* p) {
  vec8 r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline vec8 vfma(vec8 a, vec8 b, vec8 c) {
  for (int i = 0; i < 8; ++i) c.v[i] = std::fmaf(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline void vstore(float* p, vec8 a) { std::memcpy(p, a.v, sizeof(a.v)); }
#endif

// The fixed horizontal sum: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
inline float hsum(vec8 a) {
#if defined(DSPARK_AVX2) && !defined(DSPARK_SCALAR_HSUM)
  // the same four additions in registers: (lo + hi) gives (s04, s15, s26, s37); adding its upper half gives
  // (s04 + s26, s15 + s37); adding lane 1 to lane 0 gives the sum
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
#else
  alignas(32) float l[8];
  vstore(l, a);
  const float s04 = l[0] + l[4], s26 = l[2] + l[6], s15 = l[1] + l[5], s37 = l[3] + l[7];
  return (s04 + s26) + (s15 + s37);
#endif
}

// A zero-padded copy of the last K % 8 elements, so the tail goes through the same vector step.
inline vec8 vload_tail(const float* p, int64_t n) {
  alignas(32) float buf[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t i = 0; i < n; ++i) buf[i] = p[i];
  return vload(buf);
}

// out[r][c] for R rows x C columns of one tile (attention's scores, RMSNorm's sum of squares); every (r, c) keeps
// its own accumulator.
template <int R, int C>
inline void dot_tile(const float* const* xs, const float* const* ws, int64_t K, float* out, int64_t ldo,
                     const float* bias) {
  vec8 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  const int64_t full = K - K % 8;
  for (int64_t k = 0; k < full; k += 8) {
    vec8 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = vload(ws[c] + k);
    for (int r = 0; r < R; ++r) {
      const vec8 xv = vload(xs[r] + k);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
    }
  }
  if (full < K) {
    vec8 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = vload_tail(ws[c] + full, K - full);
    for (int r = 0; r < R; ++r) {
      const vec8 xv = vload_tail(xs[r] + full, K - full);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = hsum(acc[r][c]);
      if (bias != nullptr) s = s + bias[c];
      out[r * ldo + c] = s;
    }
}

}  // namespace

namespace {

// ------------------------------------------------------------------------------------------- the packed GEMM
// out[m, n] = chain(x[m], w[n]) (+ bias[n]) (+ residual[m, n]), where chain is ONE sequential fused multiply-add
// over k in ascending order: acc = 0; for k = 0 .. K-1: acc = fma(x[m, k], w[n, k], acc). No split of K, no lane-wise
// partial sums, no reassociation: the order of the floating-point operations of one output element is fixed by
// its definition, so how the computation is vectorised, tiled or threaded cannot change a bit of it.
//
// The weights are packed once into K-major panels of NR columns (panel p holds w[p*NR + j, k] at [p][k][j], the
// last panel zero-padded), so a micro-kernel of R rows (R <= MR) x NR columns holds R x NR accumulators in vector
// registers and, for each k, loads NR weights (one contiguous run) and broadcasts x[r, k]: every accumulator lane
// is one output element's chain, and the lane of a column does not depend on R. Edge rows run the same loop with
// fewer rows, edge columns compute their zero-padded lanes and do not store them. Work is split between threads
// by column panels only, so every element is computed by one thread in one pass: the thread count cannot change
// results either. The same chain on the AVX2 and scalar builds (fma is exactly rounded), so even the ISA does not.
//
// The packed copies live in a cache keyed by the weight's storage (weakly referenced: a copy goes when its weight
// is freed) and checked against the weight's version counter (an in-place update re-packs). Cost: one extra copy
// of every float32 weight the exact mode runs (SmolLM2-135M: 0.54 GB); pack_release() frees them all.

#if defined(__AVX512F__)
using gvec = __m512;
constexpr int GV = 16;  // lanes per vector
constexpr int GNV = 3;  // vectors per panel row: NR = 48
constexpr int GMR = 8;  // rows per micro-kernel: 24 accumulators, 3 weight vectors, 1 broadcast of 32 registers
inline gvec gzero() { return _mm512_setzero_ps(); }
inline gvec gload(const float* p) { return _mm512_loadu_ps(p); }
inline gvec gset1(float a) { return _mm512_set1_ps(a); }
inline gvec gfma(gvec a, gvec b, gvec c) { return _mm512_fmadd_ps(a, b, c); }
inline gvec gadd(gvec a, gvec b) { return _mm512_add_ps(a, b); }
inline void gstore(float* p, gvec a) { _mm512_storeu_ps(p, a); }
#elif defined(DSPARK_AVX2)
using gvec = __m256;
constexpr int GV = 8;
constexpr int GNV = 2;  // NR = 16
constexpr int GMR = 6;  // 12 accumulators, 2 weight vectors, 1 broadcast of 16 registers
inline gvec gzero() { return _mm256_setzero_ps(); }
inline gvec gload(const float* p) { return _mm256_loadu_ps(p); }
inline gvec gset1(float a) { return _mm256_set1_ps(a); }
inline gvec gfma(gvec a, gvec b, gvec c) { return _mm256_fmadd_ps(a, b, c); }
inline gvec gadd(gvec a, gvec b) { return _mm256_add_ps(a, b); }
inline void gstore(float* p, gvec a) { _mm256_storeu_ps(p, a); }
#else
using gvec = vec8;
constexpr int GV = 8;
constexpr int GNV = 2;
constexpr int GMR = 4;
inline gvec gzero() { return vzero(); }
inline gvec gload(const float* p) { return vload(p); }
inline gvec gset1(float a) {
  gvec r;
  for (int i = 0; i < 8; ++i) r.v[i] = a;
  return r;
}
inline gvec gfma(gvec a, gvec b, gvec c) { return vfma(a, b, c); }
inline gvec gadd(gvec a, gvec b) {
  for (int i = 0; i < 8; ++i) a.v[i] = a.v[i] + b.v[i];
  return a;
}
inline void gstore(float* p, gvec a) { vstore(p, a); }
#endif
constexpr int GNR = GV * GNV;  // columns per panel

#ifndef GEMM_PREFETCH
#define GEMM_PREFETCH 1536  // floats ahead in the panel stream (8 k steps of 48 columns)
#endif

// R rows (x + r * ldx) against one packed panel [K][GNR]: every lane's chain over k = 0 .. K-1 into tmp[r][j].
template <int R>
inline void gemm_tile(const float* x, int64_t ldx, const float* panel, int64_t K, float* tmp) {
  gvec acc[R][GNV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < GNV; ++j) acc[r][j] = gzero();
  for (int64_t k = 0; k < K; ++k) {
    const float* p = panel + k * GNR;
#ifdef DSPARK_AVX2
    // the panel 6 KB on (past its end: the next panel, which this thread is likely to take next) into L2: a hint,
    // no arithmetic. Measured on a Zen 4 core over one SmolLM2-135M forward's weights: 1 row 25% faster, 8 and 16
    // rows 10-15% (prefetching into L1 instead slowed 8 rows); research/2026-12-06-exact-gemm/.
    for (int j = 0; j < GNR; j += 16)
      _mm_prefetch(reinterpret_cast<const char*>(p + GEMM_PREFETCH + j), _MM_HINT_T1);
#endif
    gvec w[GNV];
    for (int j = 0; j < GNV; ++j) w[j] = gload(p + j * GV);
    for (int r = 0; r < R; ++r) {
      const gvec xv = gset1(x[r * ldx + k]);
      for (int j = 0; j < GNV; ++j) acc[r][j] = gfma(xv, w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < GNV; ++j) gstore(tmp + r * GNR + j * GV, acc[r][j]);
}

// ------------------------------------------------------------------------------------------- the bf16 GEMM
// The same packed GEMM with bfloat16 operands (linear_bf16, attn_in_bf16, attn_out_bf16): the weight rounded to
// bf16 once (round to nearest even; a bf16 denormal is replaced by a zero of its sign, which is what vdpbf16ps does
// with it anyway: DAZ), each row of x rounded to bf16 once per call, and every output element ONE chain over the
// k pairs (2p, 2p + 1), p = 0 .. ceil(K / 2) - 1, in ascending order, two steps per pair, in vdpbf16ps' order:
//     acc = ftz(fma(x[2p + 1], w[2p + 1], acc));  acc = ftz(fma(x[2p], w[2p], acc))
// (products of two bf16 are exact in float32; ftz: a denormal result becomes a zero of its sign; an odd K's last
// pair holds a zero). AVX-512 BF16 runs a pair of all 48 columns of a panel per row in three vdpbf16ps; without it,
// a portable kernel runs the same steps lane by lane (bit-identical: tests/kernels/test_exact_gemm_bf16.py). The
// weight's panels hold [K / 2][GNR][2] bf16 (pair-interleaved per column): half the bytes of the float32 panels.

// float32 -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN; a denormal result becomes a signed zero.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
  uint32_t h = (u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded;  // branch-free: the row loop vectorises
  h = (h & 0x7f80u) == 0 ? (h & 0x8000u) : h;
  return static_cast<uint16_t>(h);
}

#if defined(__AVX512F__)
// bf16_bits of 16 floats at once: the same integer steps, lane by lane.
inline __m256i bf16_bits16(const float* p) {
  const __m512i u = _mm512_loadu_si512(p);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  h = _mm512_mask_mov_epi32(h, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  const __mmask16 tiny = _mm512_testn_epi32_mask(h, _mm512_set1_epi32(0x7f80));
  h = _mm512_mask_mov_epi32(h, tiny, _mm512_and_si512(h, _mm512_set1_epi32(0x8000)));
  return _mm512_cvtepi32_epi16(h);
}
#endif

inline float bf16_value(uint32_t h) {
  const uint32_t u = h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// vdpbf16ps' output rule: a denormal result becomes a zero of its sign.
inline float flush_denormal(float a) { return std::fabs(a) < std::numeric_limits<float>::min() ? 0.f * a : a; }

#ifndef GEMM_PREFETCH_BF16
#define GEMM_PREFETCH_BF16 3072  // bf16 ahead in the panel stream: the float32 kernel's 6 KB (32 pairs of 48 columns)
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define DSPARK_BF16_NATIVE 1
// R rows of bf16 (x + 2 * r * ldx, ldx k pairs a row) against one packed bf16 panel [K2][GNR][2]: every lane's
// chain over the pairs into tmp[r][j].
template <int R>
inline void gemm_tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K2, float* tmp) {
  __m512 acc[R][GNV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < GNV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K2; ++p) {
    const uint16_t* q = panel + p * (2 * GNR);
    for (int j = 0; j < 2 * GNR; j += 32)
      _mm_prefetch(reinterpret_cast<const char*>(q + GEMM_PREFETCH_BF16 + j), _MM_HINT_T1);
    __m512bh w[GNV];
    for (int j = 0; j < GNV; ++j) w[j] = (__m512bh)_mm512_loadu_si512(q + j * 32);
    for (int r = 0; r < R; ++r) {
      int pair;  // x[2p] in the low half, x[2p + 1] in the high one (x86 is little-endian)
      std::memcpy(&pair, x + 2 * (r * ldx + p), 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < GNV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < GNV; ++j) _mm512_storeu_ps(tmp + r * GNR + j * GV, acc[r][j]);
}
#endif

// The same chains without AVX-512 BF16, lane by lane: the reference the native kernel is tested against, and what
// runs on CPUs without it.
template <int R>
inline void gemm_tile_bf16_portable(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K2, float* tmp) {
  alignas(64) float acc[R][GNR];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < GNR; ++j) acc[r][j] = 0.f;
  for (int64_t p = 0; p < K2; ++p) {
    const uint16_t* q = panel + p * (2 * GNR);
    alignas(64) float w0[GNR], w1[GNR];
    for (int j = 0; j < GNR; ++j) {
      w0[j] = bf16_value(q[2 * j]);
      w1[j] = bf16_value(q[2 * j + 1]);
    }
    for (int r = 0; r < R; ++r) {
      const float x0 = bf16_value(x[2 * (r * ldx + p)]), x1 = bf16_value(x[2 * (r * ldx + p) + 1]);
      for (int j = 0; j < GNR; ++j) {
        const float a = flush_denormal(std::fmaf(x1, w1[j], acc[r][j]));
        acc[r][j] = flush_denormal(std::fmaf(x0, w0[j], a));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < GNR; ++j) tmp[r * GNR + j] = acc[r][j];
}

// Whether this build runs the bf16 chains on AVX-512 BF16 (vdpbf16ps); otherwise on the portable kernel.
bool bf16_native_build() {
#ifdef DSPARK_BF16_NATIVE
  return true;
#else
  return false;
#endif
}

// Which arithmetic run_linears runs: float32 chains, bf16 chains (native where the build has AVX-512 BF16), or the
// bf16 chains on the portable kernel whatever the build (for tests).
enum class Precision { fp32, bf16, bf16_portable };

// Calls f(std::integral_constant<int, R>) for a tile of R = 1 .. GMR rows.
template <class F>
inline void with_rows(int64_t R, F&& f) {
  switch (R) {
#define DSPARK_ROWS_CASE(r) \
  case r: f(std::integral_constant<int, (r <= GMR ? r : 1)>{}); break;
    DSPARK_ROWS_CASE(1)
    DSPARK_ROWS_CASE(2)
    DSPARK_ROWS_CASE(3)
    DSPARK_ROWS_CASE(4)
    DSPARK_ROWS_CASE(5)
    DSPARK_ROWS_CASE(6)
    DSPARK_ROWS_CASE(7)
    DSPARK_ROWS_CASE(8)
#undef DSPARK_ROWS_CASE
    default: TORCH_CHECK(false, "exact gemm: micro-kernel rows");
  }
}

// One weight's packed panels, and what it was packed from.
struct PackEntry {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t N, K, s0, s1, version;
  torch::Tensor packed;  // float32 [panels, K, GNR], or bf16 [panels, ceil(K / 2), GNR, 2]
};

std::mutex pack_mutex;
std::unordered_map<const void*, PackEntry> pack_cache;       // float32 panels
std::unordered_map<const void*, PackEntry> pack_cache_bf16;  // bf16 panels of the same weights

// w [N, K] (any strides; a 1-d weight is one row) as K-major panels of GNR columns, zero-padded.
torch::Tensor pack_panels(const torch::Tensor& w, int64_t N, int64_t K, int64_t s0, int64_t s1) {
  const int64_t panels = (N + GNR - 1) / GNR;
  auto packed = torch::empty({panels, K, GNR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      float* d = dst + p * K * GNR;
      for (int64_t j = 0; j < GNR; ++j) {
        const int64_t n = p * GNR + j;
        if (n < N) {
          const float* row = src + n * s0;
          for (int64_t k = 0; k < K; ++k) d[k * GNR + j] = row[k * s1];
        } else {
          for (int64_t k = 0; k < K; ++k) d[k * GNR + j] = 0.f;
        }
      }
    }
  });
  return packed;
}

// w [N, K] rounded to bf16 as panels [ceil(K / 2)][GNR][2]: panel p holds w[p * GNR + j, 2 * q + e] at [p][q][j][e],
// zero-padded past N and past K.
torch::Tensor pack_panels_bf16(const torch::Tensor& w, int64_t N, int64_t K, int64_t s0, int64_t s1) {
  const int64_t panels = (N + GNR - 1) / GNR, K2 = (K + 1) / 2;
  auto packed = torch::empty({panels, K2, GNR, 2}, w.options().dtype(at::kBFloat16));
  const float* src = w.data_ptr<float>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint16_t* d = dst + p * K2 * GNR * 2;
      for (int64_t j = 0; j < GNR; ++j) {
        const int64_t n = p * GNR + j;
        const float* row = n < N ? src + n * s0 : nullptr;
        for (int64_t k = 0; k < 2 * K2; ++k)
          d[((k / 2) * GNR + j) * 2 + k % 2] = (row != nullptr && k < K) ? bf16_bits(row[k * s1]) : 0;
      }
    }
  });
  return packed;
}

// The packed panels of weight w [N, K] (or [K] for N = 1), from the cache or packed now.
torch::Tensor packed_weight(const torch::Tensor& w, int64_t N, int64_t K, bool bf16 = false) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.numel() == N * K, "exact linear: weight [N, K] float32");
  const int64_t s0 = w.dim() == 2 ? w.stride(0) : K, s1 = w.dim() == 2 ? w.stride(1) : w.stride(0);
  auto pack = [&]() { return bf16 ? pack_panels_bf16(w, N, K, s0, s1) : pack_panels(w, N, K, s0, s1); };
  if (w.is_inference()) return pack();  // no version counter: nothing to check a copy by
  auto& cache = bf16 ? pack_cache_bf16 : pack_cache;
  const int64_t version = w._version();
  c10::StorageImpl* storage = w.storage().unsafeGetStorageImpl();
  const void* key = w.data_ptr();
  {
    std::lock_guard<std::mutex> lock(pack_mutex);
    auto it = cache.find(key);
    if (it != cache.end()) {
      const PackEntry& e = it->second;
      auto alive = e.storage.lock();
      if (alive.get() == storage && e.N == N && e.K == K && e.s0 == s0 && e.s1 == s1 && e.version == version)
        return e.packed;
    }
  }
  torch::Tensor packed = pack();
  std::lock_guard<std::mutex> lock(pack_mutex);
  for (auto it = cache.begin(); it != cache.end();) {  // drop the copies of weights that are gone
    if (it->second.storage.expired())
      it = cache.erase(it);
    else
      ++it;
  }
  cache.erase(key);
  cache.emplace(key, PackEntry{w.storage().getWeakStorageImpl(), N, K, s0, s1, version, packed});
  return packed;
}

// One weight of a multi-linear call: out[m, n] = chain(x[m], w[n]) (+ bias[n]) (+ residual[m, n]).
struct LinearJob {
  torch::Tensor w;        // [N, K] (or [K] when N = 1), float32, any strides
  const float* bias;      // may be null: added after the chain, one IEEE add per element
  const float* residual;  // may be null: added after the bias, one IEEE add per element
  float* out;
  int64_t N;
};

// Every job's column panels in one parallel region: tile(job, panel, m, R, tmp) computes the chains of rows
// m .. m + R - 1 against the job's panel into tmp [R][GNR]; then the bias and the residual.
template <class Tile>
void run_panels(int64_t M, int64_t block_rows, const std::vector<LinearJob>& jobs, const std::vector<int64_t>& first,
                const Tile& tile) {
  at::parallel_for(0, first.back(), 1, [&](int64_t begin, int64_t end) {
    alignas(64) float tmp[GMR * GNR];
    for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
      const int64_t rows = std::min<int64_t>(block_rows, M - m0);
      size_t j = 0;
      for (int64_t t = begin; t < end; ++t) {
        while (t >= first[j + 1]) ++j;
        const LinearJob& job = jobs[j];
        const int64_t N = job.N, n0 = (t - first[j]) * GNR, cols = std::min<int64_t>(GNR, N - n0);
        for (int64_t r0 = 0; r0 < rows; r0 += GMR) {
          const int64_t R = std::min<int64_t>(GMR, rows - r0), m = m0 + r0;
          tile(j, t - first[j], m, R, tmp);
          for (int64_t r = 0; r < R; ++r) {
            float* o = job.out + (m + r) * N + n0;
            const float* res = job.residual ? job.residual + (m + r) * N + n0 : nullptr;
            const float* bias = job.bias != nullptr ? job.bias + n0 : nullptr;
            int64_t c = 0;
            // s = chain (+ bias) then residual + s: the same two additions per element, GV elements at a time
            if (cols == GNR) {
              for (; c < GNR; c += GV) {
                gvec v = gload(tmp + r * GNR + c);
                if (bias != nullptr) v = gadd(v, gload(bias + c));
                if (res != nullptr) v = gadd(gload(res + c), v);
                gstore(o + c, v);
              }
            }
            for (; c < cols; ++c) {
              float s = tmp[r * GNR + c];
              if (bias != nullptr) s = s + bias[c];
              if (res != nullptr) s = res[c] + s;
              o[c] = s;
            }
          }
        }
      }
    }
  });
}

// Every job against the same input x [M, K] (rows contiguous), in one parallel region over all jobs' column panels.
void run_linears(const float* xp, int64_t M, int64_t K, const std::vector<LinearJob>& jobs,
                 Precision precision = Precision::fp32) {
  const bool bf16 = precision != Precision::fp32;
  std::vector<torch::Tensor> packs;
  std::vector<int64_t> first(jobs.size() + 1, 0);
  for (size_t j = 0; j < jobs.size(); ++j) {
    packs.push_back(packed_weight(jobs[j].w, jobs[j].N, K, bf16));
    first[j + 1] = first[j] + (jobs[j].N + GNR - 1) / GNR;
  }
  // Rows go in blocks of about GEMM_BLOCK_BYTES of input, which stay in the core's L2 cache while the thread's
  // panels pass over them (the order in which elements are computed, never how one is).
#ifndef GEMM_BLOCK_BYTES
#define GEMM_BLOCK_BYTES 524288
#endif
  if (!bf16) {
    const int64_t block_rows = std::max<int64_t>(GMR, (GEMM_BLOCK_BYTES / (K * 4)) / GMR * GMR);
    run_panels(M, block_rows, jobs, first, [&](size_t j, int64_t p, int64_t m, int64_t R, float* tmp) {
      const float* panel = packs[j].data_ptr<float>() + p * K * GNR;
      with_rows(R, [&](auto r) { gemm_tile<decltype(r)::value>(xp + m * K, K, panel, K, tmp); });
    });
    return;
  }
  // each row of x rounded to bf16 once, as k pairs (an odd K's last pair padded with a zero)
  const int64_t K2 = (K + 1) / 2;
  // left uninitialised (a value-initialised vector would zero it on this thread alone): every element is written
  const std::unique_ptr<uint16_t[]> xb(new uint16_t[static_cast<size_t>(M * 2 * K2)]);
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* src = xp + m * K;
      uint16_t* dst = xb.get() + m * 2 * K2;
      int64_t k = 0;
#if defined(__AVX512F__)
      for (; k + 16 <= K; k += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), bf16_bits16(src + k));
#endif
      for (; k < K; ++k) dst[k] = bf16_bits(src[k]);
      if (K % 2 != 0) dst[K] = 0;
    }
  });
  const int64_t block_rows = std::max<int64_t>(GMR, (GEMM_BLOCK_BYTES / (K2 * 4)) / GMR * GMR);
  const bool native = precision == Precision::bf16 && bf16_native_build();
  run_panels(M, block_rows, jobs, first, [&](size_t j, int64_t p, int64_t m, int64_t R, float* tmp) {
    const uint16_t* panel = reinterpret_cast<const uint16_t*>(packs[j].data_ptr<at::BFloat16>()) + p * K2 * GNR * 2;
    const uint16_t* x = xb.get() + m * 2 * K2;
#ifdef DSPARK_BF16_NATIVE
    if (native) {
      with_rows(R, [&](auto r) { gemm_tile_bf16<decltype(r)::value>(x, K2, panel, K2, tmp); });
      return;
    }
#endif
    (void)native;
    with_rows(R, [&](auto r) { gemm_tile_bf16_portable<decltype(r)::value>(x, K2, panel, K2, tmp); });
  });
}

const float* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N, torch::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->contiguous();
  TORCH_CHECK(keep.scalar_type() == at::kFloat && keep.numel() == N, "exact linear: bias [N] float32");
  return keep.data_ptr<float>();
}

}  // namespace

namespace {

torch::Tensor linear_impl(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, Precision precision) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "exact linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "exact linear: x [M, K], w [N, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({M, N}, x.options());
  torch::Tensor b;
  const float* bp = bias_ptr(bias, N, b);
  run_linears(x.data_ptr<float>(), M, K, {LinearJob{w, bp, nullptr, out.data_ptr<float>(), N}}, precision);
  return out;
}

}  // namespace

torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  return linear_impl(x, w, bias, Precision::fp32);
}

// The bf16 GEMM: x and w (float32) rounded to bf16, float32 chains over the k pairs, float32 out (see above).
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  return linear_impl(x, w, bias, Precision::bf16);
}

// linear_bf16 on the portable kernel whatever the build: the reference the native kernel must equal bit for bit.
torch::Tensor linear_bf16_portable(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  return linear_impl(x, w, bias, Precision::bf16_portable);
}

// Whether linear_bf16 runs on AVX-512 BF16 (vdpbf16ps) in this build; false: on the portable kernel.
bool bf16_native() { return bf16_native_build(); }

// The bytes held by the packed copies of the weights whose storage is still alive (the others are dropped now).
int64_t pack_bytes() {
  std::lock_guard<std::mutex> lock(pack_mutex);
  int64_t total = 0;
  for (auto* cache : {&pack_cache, &pack_cache_bf16})
    for (auto it = cache->begin(); it != cache->end();) {
      if (it->second.storage.expired()) {
        it = cache->erase(it);
      } else {
        total += static_cast<int64_t>(it->second.packed.nbytes());
        ++it;
      }
    }
  return total;
}

// Frees every packed copy (the next call with a weight packs it again); returns the bytes freed.
int64_t pack_release() {
  const int64_t total = pack_bytes();
  std::lock_guard<std::mutex> lock(pack_mutex);
  pack_cache.clear();
  pack_cache_bf16.clear();
  return total;
}

// ------------------------------------------------------------------------------------------- attention
// Keys and values are read as float32 from float32 buffers or from bfloat16 ones (uint16_t bits; the exact-bf16
// mode's KV cache): a bf16 value widens to float32 exactly, so the same values give the same bits from either.
inline float kv_value(const float* p) { return *p; }
inline float kv_value(const uint16_t* p) { return bf16_value(*p); }
inline gvec kv_load(const float* p) { return gload(p); }
inline gvec kv_load(const uint16_t* p) {
#if defined(__AVX512F__)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif defined(DSPARK_AVX2)
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
  alignas(32) float tmp[GV];
  for (int l = 0; l < GV; ++l) tmp[l] = bf16_value(p[l]);
  return gload(tmp);
#endif
}
#if defined(__AVX512F__)
inline __m512 kv_load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 kv_load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

// float32 -> bf16 bits as torch's conversion (`tensor.to(torch.bfloat16)`) rounds: to nearest even, denormals kept;
// a NaN becomes a NaN. The exact-bf16 mode rounds every key and value it computes to a bf16 value this way.
inline uint16_t kv_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
// kv_bits of 16 floats at once: the same integer steps, lane by lane.
inline __m256i kv_bits16(const float* p) {
  const __m512i u = _mm512_loadu_si512(p);
  const __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}
#endif

// n floats to their bf16 bits (kv_bits), 16 at a time where the build can.
inline void kv_bits_row(const float* src, int64_t n, uint16_t* dst) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= n; d += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), kv_bits16(src + d));
#endif
  for (; d < n; ++d) dst[d] = kv_bits(src[d]);
}

// Rounds every element of a float32 tensor to its bf16 value, in place (parallel; element by element).
void round_to_bf16_(torch::Tensor t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "exact round_to_bf16_: contiguous float32");
  float* p = t.data_ptr<float>();
  at::parallel_for(0, t.numel(), 4096, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#if defined(__AVX512F__)  // kv_bits16, widened back: the same steps as the scalar loop
    for (; i + 16 <= end; i += 16)
      _mm512_storeu_ps(p + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(kv_bits16(p + i)), 16)));
#endif
    for (; i < end; ++i) p[i] = bf16_value(kv_bits(p[i]));
  });
}

// Rows of the next attention unit's keys or values, brought toward the core's L2 cache a few at a time while this
// unit computes (a decoding step reads every row's cache once, from memory; prefetches change no value).
struct Ahead {
  const char* base = nullptr;
  int64_t stride = 0, row = 0, next = 0, n = 0;  // bytes between rows, bytes of a row, next row, rows
  // rows 0 .. n - 1 of D elements of T, row j at p + j * stride
  template <typename T>
  static Ahead of(const T* p, int64_t stride, int64_t D, int64_t n) {
    const int64_t size = static_cast<int64_t>(sizeof(T));
    return {reinterpret_cast<const char*>(p), stride * size, D * size, 0, n};
  }
  inline void fetch(int64_t rows) {
#if defined(__GNUC__)
    for (const int64_t end = std::min(n, next + rows); next < end; ++next)
      for (int64_t b = 0; b < row; b += 64) __builtin_prefetch(base + next * stride + b, 0, 2);
#else
    (void)rows;
#endif
  }
};

// A query's raw score against a key over the head dimension D: 16 partial sums, lane l the fma chain over
// d = l, l + 16, l + 32, ... in ascending order (a zero-padded last chunk), then one fixed tree over the 16 lanes:
// u[l] = p[l] + p[l + 8], v[l] = u[l] + u[l + 4], w[l] = v[l] + v[l + 2], score = w[0] + w[1]. The AVX-512 build
// reduces 16 keys' lanes at once with shuffles that add the same pairs; other builds run the chains and the tree
// lane by lane: the same operations, so the same bits on every ISA.
inline float tree16(const float* p) {
  float u[8], v[4], w[2];
  for (int l = 0; l < 8; ++l) u[l] = p[l] + p[l + 8];
  for (int l = 0; l < 4; ++l) v[l] = u[l] + u[l + 4];
  for (int l = 0; l < 2; ++l) w[l] = v[l] + v[l + 2];
  return w[0] + w[1];
}

// exp of an attention weight's argument (x = score - max <= 0): x clamped to [-87.33654, 88], n = nearest integer
// to x * log2(e) (ties to even), r = x - n * ln2 in two fma steps (ln2 = 0.693359375 - 2.12194440e-4), a degree-5
// polynomial by Horner's fma chain, y = fma(poly, r * r, r) + 1, times 2^n (built in the exponent bits). About
// 2 ulp from exp; its value depends on x alone, one fixed sequence of operations, on every ISA and lane.
constexpr float kExpLo = -87.33654f, kExpHi = 88.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP0 = 1.9875691500e-4f, kExpP1 = 1.3981999507e-3f, kExpP2 = 8.3334519073e-3f;
constexpr float kExpP3 = 4.1665795894e-2f, kExpP4 = 1.6666665459e-1f, kExpP5 = 5.0000001201e-1f;

inline float exp_weight(float x) {
  x = x > kExpLo ? x : kExpLo;  // (NaN -> kExpLo, as the vector max below)
  x = x < kExpHi ? x : kExpHi;
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = kExpP0;
  p = std::fma(p, r, kExpP1);
  p = std::fma(p, r, kExpP2);
  p = std::fma(p, r, kExpP3);
  p = std::fma(p, r, kExpP4);
  p = std::fma(p, r, kExpP5);
  const float y = std::fma(p, r * r, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return y * two_n;
}

#if defined(__AVX512F__)
inline __m512 exp_weight16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpLo));
  x = _mm512_min_ps(x, _mm512_set1_ps(kExpHi));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP5));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// 16 keys' partial sums (acc[kk]: key kk's 16 lanes) -> their 16 scores in key order, each by tree16's additions:
// the first step adds lanes l and l + 8 of keys m and m + 8 in one vector, the next l and l + 4, and so on; the
// lanes come out in the order (0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), which the last permute undoes.
inline __m512 reduce_keys16(const __m512* a) {
  __m512 p[8], q[4], r[2];
  for (int m = 0; m < 8; ++m)
    p[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[m], a[m + 8], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[m], a[m + 8], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int m = 0; m < 4; ++m)
    q[m] = _mm512_add_ps(_mm512_shuffle_f32x4(p[m], p[m + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(p[m], p[m + 4], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int m = 0; m < 2; ++m)
    r[m] = _mm512_add_ps(_mm512_shuffle_ps(q[m], q[m + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(q[m], q[m + 2], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, s);
}
#endif

// Raw scores of one query (q, D floats) against keys 0 .. n - 1, lane by lane (builds without AVX-512, and head
// dimensions other than 64 and 128; score_unit16 below runs the same chains 16 lanes at a time).
template <typename T>
inline void score_keys(const float* q, const T* kb, int64_t kstride, int64_t n, int64_t D, float* out, Ahead& ahead) {
  ahead.fetch(n);
  // the chains lane by lane (a skipped padded lane is the fma with zeros: the chains start at +0 and never reach -0)
  for (int64_t j = 0; j < n; ++j) {
    const T* kr = kb + j * kstride;
    float part[16] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t d0 = 0; d0 < D; d0 += 16)
      for (int64_t l = 0; l < 16 && d0 + l < D; ++l) part[l] = std::fma(q[d0 + l], kv_value(kr + d0 + l), part[l]);
    out[j] = tree16(part);
  }
}

#if defined(__AVX512F__)
// The raw scores of a unit's nq queries (query r against keys 0 .. e[r] - 1, into s + r * stride), 16 keys at a
// time: each block of keys is read, and widened from bf16, once for all the queries (into an L1-resident copy),
// then each query runs its own chains over it: per key, 16 lanes of fmas over the D / 16 chunks in order, then
// reduce_keys16's tree. Which queries share a block changes no query's operations.
template <int C, typename T>
inline void score_unit16(int64_t nq, const float* const* q, const int64_t* e, const T* kb, int64_t kstride, float* s,
                         int64_t stride, Ahead& ahead) {
  constexpr int64_t D = 16 * C;
  alignas(64) float blk[16 * D];
  int64_t n = 0;
  for (int64_t r = 0; r < nq; ++r) n = std::max(n, e[r]);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    ahead.fetch(16);
    const int64_t m = std::min<int64_t>(16, n - j0);
    const float* k0;
    int64_t ks;
    if constexpr (std::is_same<T, float>::value) {
      k0 = kb + j0 * kstride;
      ks = kstride;
    } else {
      for (int64_t kk = 0; kk < m; ++kk)
        for (int c = 0; c < C; ++c) _mm512_store_ps(blk + kk * D + 16 * c, kv_load16(kb + (j0 + kk) * kstride + 16 * c));
      k0 = blk;
      ks = D;
    }
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t mr = std::min<int64_t>(16, e[r] - j0);
      if (mr <= 0) continue;
      __m512 qv[C];
      for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q[r] + 16 * c);
      __m512 acc[16];
      for (int kk = 0; kk < 16; ++kk) acc[kk] = _mm512_setzero_ps();
      float* out = s + r * stride + j0;
      if (mr == 16) {
        for (int kk = 0; kk < 16; ++kk)
          for (int c = 0; c < C; ++c) acc[kk] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k0 + kk * ks + 16 * c), acc[kk]);
        _mm512_storeu_ps(out, reduce_keys16(acc));
      } else {
        for (int c = 0; c < C; ++c)
          for (int64_t kk = 0; kk < mr; ++kk)
            acc[kk] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k0 + kk * ks + 16 * c), acc[kk]);
        _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << mr) - 1), reduce_keys16(acc));
      }
    }
  }
}
#endif

// s[j] = s[j] * sc for j < e, and the largest of them (a NaN never is; -inf when there is none): the maximum over
// keys that are all visible. Vectorised, the same value as the scalar scan (the sign of a zero maximum may differ,
// which no exp_weight(s - max) can tell apart).
inline float scale_max(float* s, int64_t e, float sc) {
  int64_t j = 0;
  float mx = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  const __m512 scv = _mm512_set1_ps(sc);
  __m512 mv = _mm512_set1_ps(mx);
  for (; j + 16 <= e; j += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j), scv);
    _mm512_storeu_ps(s + j, x);
    mv = _mm512_max_ps(x, mv);  // a NaN in x leaves mv's lane (the second operand) as it was
  }
  if (j < e) {
    const __mmask16 k = static_cast<__mmask16>((1u << (e - j)) - 1);
    const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), scv);
    _mm512_mask_storeu_ps(s + j, k, x);
    mv = _mm512_mask_max_ps(mv, k, x, mv);
    j = e;
  }
  mx = _mm512_reduce_max_ps(mv);
#endif
  for (; j < e; ++j) {
    s[j] = s[j] * sc;
    if (s[j] > mx) mx = s[j];
  }
  return mx;
}

// p[j] = exp_weight(s[j] - mx) for j < n.
inline void exp_weights(const float* s, float mx, int64_t n, float* p) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 m = _mm512_set1_ps(mx);
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(p + j, exp_weight16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m)));
  if (j < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - j)) - 1);
    _mm512_mask_storeu_ps(p + j, k, exp_weight16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), m)));
    return;
  }
#endif
  for (; j < n; ++j) p[j] = exp_weight(s[j] - mx);
}

// The weighted sums of Q queries' values over the keys all of them see (j < jn, no key hidden from any of them):
// for each key in ascending order, denom[r] += p[r][j] and acc[r][d] = fma(p[r][j], v[j, d], acc[r][d]). Each query's
// chains are its own (the values are loaded once for the Q queries); NV vectors of GV lanes per value row.
template <int NV, int Q, typename T>
inline void weighted_values_shared(const float* const* p, int64_t jn, const T* vb, int64_t vstride, gvec (*acc)[NV],
                                   float* denom, Ahead& ahead) {
  for (int64_t j = 0; j < jn; ++j) {
    ahead.fetch(1);
    const T* vj = vb + j * vstride;
    gvec vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = kv_load(vj + c * GV);
    for (int r = 0; r < Q; ++r) {
      const float pr = p[r][j];
      denom[r] = denom[r] + pr;
      const gvec pv = gset1(pr);
      for (int c = 0; c < NV; ++c) acc[r][c] = gfma(pv, vv[c], acc[r][c]);
    }
  }
}

// One query's weighted sum continued over keys j0 .. jend - 1 it sees (seen[j]), then divided by the denominator.
template <int NV, typename T>
inline void weighted_values_rest(const float* p, const char* seen, int64_t j0, int64_t jend, const T* vb,
                                 int64_t vstride, gvec* acc, float denom, float* oi) {
  for (int64_t j = j0; j < jend; ++j) {
    if (!seen[j]) continue;
    denom = denom + p[j];
    const gvec pv = gset1(p[j]);
    const T* vj = vb + j * vstride;
    for (int c = 0; c < NV; ++c) acc[c] = gfma(pv, kv_load(vj + c * GV), acc[c]);
  }
  alignas(64) float tmp[GV];
  for (int c = 0; c < NV; ++c) {
    gstore(tmp, acc[c]);
    for (int l = 0; l < GV; ++l) oi[c * GV + l] = tmp[l] / denom;
  }
}

// Any head dimension: the same chains, one lane at a time.
template <typename T>
inline void weighted_values_any(const float* p, const char* seen, int64_t jend, const T* vb, int64_t vstride,
                                int64_t D, float* oi) {
  float denom = 0.f;
  for (int64_t d = 0; d < D; ++d) oi[d] = 0.f;
  for (int64_t j = 0; j < jend; ++j) {
    if (!seen[j]) continue;
    denom = denom + p[j];
    const T* vj = vb + j * vstride;
    for (int64_t d = 0; d < D; ++d) oi[d] = std::fma(p[j], kv_value(vj + d), oi[d]);
  }
  for (int64_t d = 0; d < D; ++d) oi[d] = oi[d] / denom;
}

// The values of a unit's queries: groups of up to four queries share the loads of the keys all of them see, then
// each finishes alone. Only with NV * GV == D.
template <int NV, typename T>
void unit_values(int64_t nq, float* const* pr, const char* const* seenr, const int64_t* jend, const int64_t* jfull,
                 const bool* live, const T* vb, int64_t vstride, float* const* outr, Ahead& ahead) {
  for (int64_t g = 0; g < nq; g += 4) {
    const int64_t gn = std::min<int64_t>(4, nq - g);
    int64_t jn = std::numeric_limits<int64_t>::max();
    for (int64_t r = g; r < g + gn; ++r) jn = live[r] ? std::min(jn, jfull[r]) : 0;
    gvec acc[4][NV];
    float denom[4] = {0.f, 0.f, 0.f, 0.f};
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < NV; ++c) acc[r][c] = gzero();
    const float* pg[4] = {pr[g], gn > 1 ? pr[g + 1] : nullptr, gn > 2 ? pr[g + 2] : nullptr, gn > 3 ? pr[g + 3] : nullptr};
    if (jn > 0) {
      if (gn == 4) weighted_values_shared<NV, 4, T>(pg, jn, vb, vstride, acc, denom, ahead);
      else if (gn == 3) weighted_values_shared<NV, 3, T>(pg, jn, vb, vstride, acc, denom, ahead);
      else if (gn == 2) weighted_values_shared<NV, 2, T>(pg, jn, vb, vstride, acc, denom, ahead);
      else weighted_values_shared<NV, 1, T>(pg, jn, vb, vstride, acc, denom, ahead);
    } else {
      jn = 0;
    }
    for (int64_t r = g; r < g + gn; ++r) {
      if (!live[r]) continue;
      weighted_values_rest<NV, T>(pr[r], seenr[r], jn, jend[r], vb, vstride, acc[r - g], denom[r - g], outr[r]);
    }
  }
  ahead.fetch(ahead.n);
}

// Scratch of one thread's attention units: per query a row of `stride` scores, weights and visible-key flags.
struct AttnScratch {
  int64_t stride = 0;
  std::vector<float> scores, weights;
  std::vector<char> seen;
  std::vector<const float*> qr;
  std::vector<float*> pr, outr;
  std::vector<const char*> seenr;
  std::vector<int64_t> jend, jfull;
  std::vector<char> live;
  AttnScratch(int64_t cap, int64_t stride_)
      : stride(stride_), scores(cap * stride_), weights(cap * stride_), seen(cap * stride_), qr(cap), pr(cap),
        outr(cap), seenr(cap), jend(cap), jfull(cap), live(cap) {}
  char* seen_row(int64_t r) { return seen.data() + r * stride; }
};

// One unit: nq queries over the keys of one key/value head (key j at kb + j * kstride, value at vb + j * vstride).
// The caller has set, per query r: qr[r], outr[r], jend[r] (its last visible key + 1), the flags seen_row(r)[j] for
// j < jend[r] and jfull[r] (the first hidden key, else jend[r]). Per query: the raw scores of keys j < jend[r]
// (score_keys), the scaled scores s = raw * scale, their maximum over the visible keys, p = exp_weight(s - max),
// the weighted sum of the visible keys' values in ascending key order, divided by the sum of p accumulated in the
// same order (a query that sees nothing: zeros). Which queries share a unit (and share loads) never changes the
// operations of one query.
template <typename T>
void attend_unit(int64_t nq, AttnScratch& a, const T* kb, int64_t kstride, const T* vb, int64_t vstride, int64_t D,
                 float sc, Ahead next_k = {}, Ahead next_v = {}) {
  bool scored = false;
#if defined(__AVX512F__)
  if (D == 64 || D == 128) {
    if (D == 64) score_unit16<4>(nq, a.qr.data(), a.jend.data(), kb, kstride, a.scores.data(), a.stride, next_k);
    else score_unit16<8>(nq, a.qr.data(), a.jend.data(), kb, kstride, a.scores.data(), a.stride, next_k);
    scored = true;
  }
#endif
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t e = a.jend[r];
    const char* sr = a.seen_row(r);
    float* s = a.scores.data() + r * a.stride;
    a.seenr[r] = sr;
    a.pr[r] = a.weights.data() + r * a.stride;
    if (!scored) score_keys(a.qr[r], kb, kstride, e, D, s, next_k);
    float mx = -std::numeric_limits<float>::infinity();
    if (a.jfull[r] == e) {  // every key below e visible
      mx = scale_max(s, e, sc);
    } else {
      for (int64_t j = 0; j < e; ++j) {
        s[j] = s[j] * sc;
        if (sr[j] && s[j] > mx) mx = s[j];
      }
    }
    a.live[r] = mx != -std::numeric_limits<float>::infinity();
    if (!a.live[r]) {  // nothing visible (a fully padded row): zeros
      for (int64_t d = 0; d < D; ++d) a.outr[r][d] = 0.f;
      continue;
    }
    exp_weights(s, mx, e, a.pr[r]);
  }
  next_k.fetch(next_k.n);
  const bool* live = reinterpret_cast<const bool*>(a.live.data());
  if (D == 4 * GV)
    unit_values<4, T>(nq, a.pr.data(), a.seenr.data(), a.jend.data(), a.jfull.data(), live, vb, vstride, a.outr.data(), next_v);
  else if (D == 8 * GV)
    unit_values<8, T>(nq, a.pr.data(), a.seenr.data(), a.jend.data(), a.jfull.data(), live, vb, vstride, a.outr.data(), next_v);
  else {
    next_v.fetch(next_v.n);
    for (int64_t r = 0; r < nq; ++r)
      if (live[r]) weighted_values_any(a.pr[r], a.seenr[r], a.jend[r], vb, vstride, D, a.outr[r]);
  }
}

// Runs body(begin, end) over units 0 .. cost.size() - 1 split into one contiguous run per thread of about equal total
// cost (cost[u]: the keys unit u's queries score, plus a fixed share for its set-up), not of equal count: a causal
// chunk's late units see many more keys than its early ones, and an even split by count left one thread most of
// the work. Which thread computes a unit changes none of its operations.
template <class F>
void parallel_units(const std::vector<int64_t>& cost, const F& body) {
  const int64_t n = static_cast<int64_t>(cost.size());
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), n);
  if (parts <= 1 || at::in_parallel_region()) {
    if (n > 0) body(0, n);
    return;
  }
  int64_t total = 0;
  for (int64_t c : cost) total += c;
  std::vector<int64_t> bounds(parts + 1, n);
  bounds[0] = 0;
  int64_t u = 0, acc = 0;
  for (int64_t t = 1; t < parts; ++t) {  // the first unit at which the running cost reaches t / parts of the total
    while (u < n && acc * parts < total * t) acc += cost[u++];
    bounds[t] = u;
  }
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      if (bounds[t] < bounds[t + 1]) body(bounds[t], bounds[t + 1]);
  });
}

constexpr int64_t kUnitPositions = 4;  // query positions per attention unit (with all heads of one kv head)

// q [B, Hq, Lq, D], k and v [B, Hkv, Lk, D] (any strides with a contiguous last dim), mask: empty (causal: query
// i sees keys 0 .. Lk - Lq + i) or bool broadcastable to [B, Hq, Lq, Lk] (true = may attend).
// Returns [B, Lq, Hq, D] (the layout transformers' attention functions return).
//
// Work is split into units of one (batch, key/value head) and up to four consecutive query positions, with all
// the query heads that share the key/value head (attend_unit), over the threads; a query's output depends only on
// it and the keys and values it sees.
// The keys and values of one call: float32, or bfloat16 (both).
bool kv_bf16(const torch::Tensor& k, const torch::Tensor& v, const char* what) {
  const bool bf16 = k.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || k.scalar_type() == at::kFloat) && v.scalar_type() == k.scalar_type(), what,
              ": keys and values both float32 or both bfloat16");
  return bf16;
}

template <typename T>
const T* kv_data(const torch::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}

torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "exact attention: float32 queries");
  const bool bf16 = kv_bf16(k, v, "exact attention");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "exact attention: 4-d q, k, v");
  if (q.stride(3) != 1) q = q.contiguous();
  if (k.stride(3) != 1) k = k.contiguous();
  if (v.stride(3) != 1) v = v.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2);
  TORCH_CHECK(Hq % Hkv == 0, "exact attention: query heads must be a multiple of key/value heads");
  TORCH_CHECK(v.size(2) == Lk && v.size(3) == D && k.size(3) == D, "exact attention: k/v shapes");
  const int64_t rep = Hq / Hkv;
  const bool has_mask = mask.defined() && mask.numel() > 0;
  torch::Tensor m;
  if (has_mask) {
    TORCH_CHECK(mask.scalar_type() == at::kBool, "exact attention: bool mask");
    m = mask.expand({B, Hq, Lq, Lk});
  }
  auto out = torch::empty({B, Lq, Hq, D}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool* mp = has_mask ? m.data_ptr<bool>() : nullptr;
  const auto qs = q.strides(), ks = k.strides(), vs = v.strides();
  const int64_t ms0 = has_mask ? m.stride(0) : 0, ms1 = has_mask ? m.stride(1) : 0;
  const int64_t ms2 = has_mask ? m.stride(2) : 0, ms3 = has_mask ? m.stride(3) : 0;
  const float sc = static_cast<float>(scale);
  const int64_t groups = (Lq + kUnitPositions - 1) / kUnitPositions;
  std::vector<int64_t> cost(B * Hkv * groups);
  for (int64_t idx = 0; idx < B * Hkv * groups; ++idx) {  // keys a unit's queries may see (causal: up to its last)
    const int64_t last = std::min<int64_t>((idx % groups) * kUnitPositions + kUnitPositions, Lq) - 1;
    const int64_t keys = has_mask ? Lk : std::max<int64_t>(0, std::min<int64_t>(Lk, Lk - Lq + last + 1));
    cost[idx] = (std::min<int64_t>(kUnitPositions, Lq - (idx % groups) * kUnitPositions) * rep) * (keys + 16);
  }
  auto run = [&](auto kp, auto vp) {
  parallel_units(cost, [&](int64_t begin, int64_t end) {
    AttnScratch a(kUnitPositions * rep, std::max<int64_t>(Lk, 1));
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / (Hkv * groups), hk = (idx / groups) % Hkv, i0 = (idx % groups) * kUnitPositions;
      const int64_t nq = std::min<int64_t>(kUnitPositions, Lq - i0) * rep;
      for (int64_t r = 0; r < nq; ++r) {  // query r: position i0 + r / rep, head hk * rep + r % rep
        const int64_t i = i0 + r / rep, h = hk * rep + r % rep;
        char* sr = a.seen_row(r);
        int64_t e, full;
        if (has_mask) {  // keys past the last one the mask allows are never visible
          const bool* mr = mp + b * ms0 + h * ms1 + i * ms2;
          e = Lk;
          while (e > 0 && !mr[(e - 1) * ms3]) --e;
          full = e;
          for (int64_t j = 0; j < e; ++j) {
            sr[j] = mr[j * ms3];
            if (!sr[j] && full == e) full = j;  // the first hidden key: loads shared with other queries stop there
          }
        } else {  // causal over the cache
          e = std::max<int64_t>(0, std::min<int64_t>(Lk, Lk - Lq + i + 1));
          full = e;
          std::memset(sr, 1, e);
        }
        a.jend[r] = e;
        a.jfull[r] = full;
        a.qr[r] = qp + b * qs[0] + h * qs[1] + i * qs[2];
        a.outr[r] = op + ((b * Lq + i) * Hq + h) * D;
      }
      Ahead nk, nv;
      if (idx + 1 < end) {  // the thread's next unit: its keys and values, rows 0 .. its last position's past
        const int64_t b2 = (idx + 1) / (Hkv * groups), hk2 = ((idx + 1) / groups) % Hkv;
        const int64_t last = std::min<int64_t>(((idx + 1) % groups) * kUnitPositions + kUnitPositions, Lq) - 1;
        const int64_t rows = has_mask ? Lk : std::max<int64_t>(0, std::min<int64_t>(Lk, Lk - Lq + last + 1));
        nk = Ahead::of(kp + b2 * ks[0] + hk2 * ks[1], ks[2], D, rows);
        nv = Ahead::of(vp + b2 * vs[0] + hk2 * vs[1], vs[2], D, rows);
      }
      attend_unit(nq, a, kp + b * ks[0] + hk * ks[1], ks[2], vp + b * vs[0] + hk * vs[1], vs[2], D, sc, nk, nv);
    }
  });
  };
  if (bf16) run(kv_data<uint16_t>(k), kv_data<uint16_t>(v));
  else run(kv_data<float>(k), kv_data<float>(v));
  return out;
}

// Attention of packed query rows over per-sequence KV slots: q [1, Hq, N, D] (rows of S segments one after another),
// kbuf and vbuf [slots, Hkv, capacity, D]; segment s is `lens[s]` rows of the sequence in slot `slots[s]` at positions
// pasts[s] .. pasts[s] + lens[s] - 1, whose keys and values are already in the slot. Its row i sees the slot's keys
// 0 .. pasts[s] + i (causal). Returns [N, Hq * D]. The same units and operations per query as `attention`: a
// sequence's rows give the bits they give in a [B, Hq, L, D] call with a mask, whatever else is packed beside them.
torch::Tensor attention_segments(torch::Tensor q, torch::Tensor kbuf, torch::Tensor vbuf, const std::vector<int64_t>& slots,
                                 const std::vector<int64_t>& pasts, const std::vector<int64_t>& lens, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "exact attention_segments: float32 queries");
  const bool bf16 = kv_bf16(kbuf, vbuf, "exact attention_segments");
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && kbuf.dim() == 4 && vbuf.sizes() == kbuf.sizes(),
              "exact attention_segments: q [1, Hq, N, D], kbuf and vbuf [slots, Hkv, capacity, D]");
  TORCH_CHECK(kbuf.stride(3) == 1 && vbuf.stride(3) == 1, "exact attention_segments: contiguous head dim");
  if (q.stride(3) != 1) q = q.contiguous();
  const int64_t Hq = q.size(1), N = q.size(2), D = q.size(3), Hkv = kbuf.size(1), cap = kbuf.size(2);
  TORCH_CHECK(Hq % Hkv == 0 && kbuf.size(3) == D, "exact attention_segments: head shapes");
  const int64_t S = static_cast<int64_t>(slots.size()), rep = Hq / Hkv;
  TORCH_CHECK(static_cast<int64_t>(pasts.size()) == S && static_cast<int64_t>(lens.size()) == S,
              "exact attention_segments: one slot, past and length per segment");
  std::vector<int64_t> unit_seg, unit_first;  // units: (segment, first row of up to four), then x Hkv
  int64_t total = 0, widest = 1;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(0 <= slots[s] && slots[s] < kbuf.size(0) && pasts[s] >= 0 && lens[s] >= 0 &&
                    pasts[s] + lens[s] <= cap,
                "exact attention_segments: segment outside the buffers");
    for (int64_t i = 0; i < lens[s]; i += kUnitPositions) {
      unit_seg.push_back(s);
      unit_first.push_back(i);
    }
    widest = std::max(widest, pasts[s] + lens[s]);
    total += lens[s];
  }
  TORCH_CHECK(total == N, "exact attention_segments: the segments' rows must add up to q's");
  std::vector<int64_t> offset(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) offset[s + 1] = offset[s] + lens[s];
  auto out = torch::empty({N, Hq * D}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto qs = q.strides(), ks = kbuf.strides(), vs = vbuf.strides();
  const float sc = static_cast<float>(scale);
  const int64_t units = static_cast<int64_t>(unit_seg.size());
  std::vector<int64_t> cost(units * Hkv);
  for (int64_t idx = 0; idx < units * Hkv; ++idx) {  // keys a unit's queries see
    const int64_t u = idx / Hkv, s = unit_seg[u], n = std::min<int64_t>(kUnitPositions, lens[s] - unit_first[u]);
    cost[idx] = n * rep * (pasts[s] + unit_first[u] + n + 16);
  }
  auto run = [&](auto kp, auto vp) {
  parallel_units(cost, [&](int64_t begin, int64_t end) {
    AttnScratch a(kUnitPositions * rep, widest);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t u = idx / Hkv, hk = idx % Hkv, s = unit_seg[u], i0 = unit_first[u];
      const int64_t nq = std::min<int64_t>(kUnitPositions, lens[s] - i0) * rep;
      for (int64_t r = 0; r < nq; ++r) {
        const int64_t i = i0 + r / rep, h = hk * rep + r % rep, row = offset[s] + i;
        const int64_t e = pasts[s] + i + 1;
        std::memset(a.seen_row(r), 1, e);
        a.jend[r] = e;
        a.jfull[r] = e;
        a.qr[r] = qp + h * qs[1] + row * qs[2];
        a.outr[r] = op + (row * Hq + h) * D;
      }
      Ahead nk, nv;
      if (idx + 1 < end) {  // the thread's next unit: its keys and values, rows 0 .. its last position's past
        const int64_t u2 = (idx + 1) / Hkv, hk2 = (idx + 1) % Hkv, s2 = unit_seg[u2];
        const int64_t rows = pasts[s2] + std::min<int64_t>(unit_first[u2] + kUnitPositions, lens[s2]);
        nk = Ahead::of(kp + slots[s2] * ks[0] + hk2 * ks[1], ks[2], D, rows);
        nv = Ahead::of(vp + slots[s2] * vs[0] + hk2 * vs[1], vs[2], D, rows);
      }
      attend_unit(nq, a, kp + slots[s] * ks[0] + hk * ks[1], ks[2], vp + slots[s] * vs[0] + hk * vs[1], vs[2], D, sc,
                  nk, nv);
    }
  });
  };
  if (bf16) run(kv_data<uint16_t>(kbuf), kv_data<uint16_t>(vbuf));
  else run(kv_data<float>(kbuf), kv_data<float>(vbuf));
  return out;
}

// The small per-row operations of a decoder layer, so that the exact mode's lean layer path
// (dspark_hf/kernels/lean.py) runs them in one call each instead of several PyTorch operations. Like the
// kernels above, each output element depends only on its own row and is computed in a fixed order. A call of a few
// rows runs on the calling thread (its work is below what an OpenMP region's start-up costs); a prefill chunk's
// hundreds of rows are split over the threads (row_grain), which changes no row's operations.
constexpr int64_t kRowGrainElements = 32768;
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, kRowGrainElements / std::max<int64_t>(width, 1)); }

// RMSNorm over the last dimension: out[m, n] = w[n] * (x[m, n] * (1 / sqrt(sum_n x[m, n]^2 / N + eps))). The sum of
// squares is attention's fixed-order 8-lane dot product.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "exact rms_norm: float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0), "exact rms_norm: x [M, N], w [N]");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), N = x.size(1);
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, M, row_grain(N), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = xp + m * N;
      const float* xs[1] = {row};
      float ss;
      dot_tile<1, 1>(xs, xs, N, &ss, 1, nullptr);
      const float r = 1.0f / std::sqrt(ss / static_cast<float>(N) + e);
      float* o = op + m * N;
      for (int64_t n = 0; n < N; ++n) o[n] = wp[n] * (row[n] * r);
    }
  });
  return out;
}

// Rotary position embedding of one projection, with the layout change attention needs: x [B, L, H * D] (a linear's
// output) and cos, sin [B, L, D] give out [B, H, L, D] with out = x * cos + rotate_half(x) * sin, where
// rotate_half(x) = (-x[D/2:], x[:D/2]) (the Llama/Qwen "rotate half" convention).
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "exact rope: float32 only");
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 3 && sin.dim() == 3, "exact rope: x [B, L, H*D], cos/sin [B, L, D]");
  x = x.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t B = x.size(0), L = x.size(1), D = cos.size(2), H = heads, half = D / 2;
  TORCH_CHECK(D % 2 == 0 && x.size(2) == H * D && cos.size(1) == L && sin.sizes() == cos.sizes(),
              "exact rope: shapes");
  TORCH_CHECK(cos.size(0) == B || cos.size(0) == 1, "exact rope: cos/sin batch");
  auto out = torch::empty({B, H, L, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool shared = cos.size(0) == 1;
  at::parallel_for(0, B * L, row_grain(H * D), [&](int64_t begin, int64_t end) {
    for (int64_t bl = begin; bl < end; ++bl) {
      const int64_t b = bl / L, l = bl % L, cb = shared ? 0 : b;
      const float* c = cp + (cb * L + l) * D;
      const float* s = sp + (cb * L + l) * D;
      for (int64_t h = 0; h < H; ++h) {
        const float* xi = xp + ((b * L + l) * H + h) * D;
        float* o = op + ((b * H + h) * L + l) * D;
        for (int64_t d = 0; d < half; ++d) o[d] = xi[d] * c[d] + (-xi[d + half]) * s[d];
        for (int64_t d = half; d < D; ++d) o[d] = xi[d] * c[d] + xi[d - half] * s[d];
      }
    }
  });
  return out;
}

// SwiGLU's gate: out = silu(g) * u with silu(g) = g / (1 + exp(-g)), element by element, exp by exp_weight.
torch::Tensor silu_mul(torch::Tensor g, torch::Tensor u) {
  TORCH_CHECK(g.scalar_type() == at::kFloat && u.scalar_type() == at::kFloat, "exact silu_mul: float32 only");
  TORCH_CHECK(g.sizes() == u.sizes(), "exact silu_mul: g and u of one shape");
  g = g.contiguous();
  u = u.contiguous();
  auto out = torch::empty_like(g);
  const float* gp = g.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t n = g.numel();
  // element by element (exp_weight's exp: its clamp leaves silu at g for g > 87 and at ~g * 6e-39 below -88),
  // vectorised in blocks of 16 split over the threads: neither changes an element's operations
  at::parallel_for(0, (n + 15) / 16, 64, [&](int64_t begin, int64_t end) {
    int64_t i = begin * 16;
    const int64_t stop = std::min(n, end * 16);
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= stop; i += 16) {
      const __m512 gv = _mm512_loadu_ps(gp + i);
      const __m512 e = exp_weight16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
      _mm512_storeu_ps(op + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(up + i)));
    }
#endif
    for (; i < stop; ++i) op[i] = (gp[i] / (1.0f + exp_weight(-gp[i]))) * up[i];
  });
  return out;
}

// ------------------------------------------------------------------------------------------- fused decoder layer
// The exact mode's lean decoder-layer path (dspark_hf/kernels/lean.py) in two calls per layer, around the KV
// cache's update (which stays in Python): the same kernels as above, called in the same order on the same
// values, so the results are bit-identical to calling them one by one; what goes away is a dozen Python-level
// calls per layer and, with the projections sharing one parallel region, five of the seven fork/joins.

// Pre-attention half: RMSNorm, the q/k/v projections, Qwen3's per-head q/k RMSNorm when its weights are given,
// rotary embedding; in the bf16 modes the keys and values are then rounded to bf16 values. x [M = B * L, W]; returns q [B, Hq, L, D], k [B, Hkv, L, D] and v [B, Hkv, L, D] (a view).
namespace {

std::vector<torch::Tensor> attn_in_impl(torch::Tensor x, torch::Tensor ln_w, double eps, torch::Tensor wq,
                                        c10::optional<torch::Tensor> bq, torch::Tensor wk,
                                        c10::optional<torch::Tensor> bk, torch::Tensor wv,
                                        c10::optional<torch::Tensor> bv, c10::optional<torch::Tensor> qn_w,
                                        c10::optional<torch::Tensor> kn_w, double q_eps, double k_eps, torch::Tensor cos,
                                        torch::Tensor sin, int64_t batch, int64_t length, int64_t hq, int64_t hkv,
                                        Precision precision) {
  TORCH_CHECK(wq.scalar_type() == at::kFloat && wk.scalar_type() == at::kFloat && wv.scalar_type() == at::kFloat,
              "exact attn_in: float32 weights");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == batch * length, "exact attn_in: x [B * L, W]");
  const int64_t M = x.size(0), K = x.size(1), D = cos.size(2);
  TORCH_CHECK(wq.size(1) == K && wk.size(1) == K && wv.size(1) == K, "exact attn_in: weight widths");
  TORCH_CHECK(wq.size(0) == hq * D && wk.size(0) == hkv * D && wv.size(0) == hkv * D, "exact attn_in: head shapes");
  const torch::Tensor h = rms_norm(x, ln_w, eps);
  auto q = torch::empty({M, hq * D}, x.options());
  auto k = torch::empty({M, hkv * D}, x.options());
  auto v = torch::empty({M, hkv * D}, x.options());
  torch::Tensor kb_q, kb_k, kb_v;
  run_linears(h.data_ptr<float>(), M, K,
              {LinearJob{wq, bias_ptr(bq, hq * D, kb_q), nullptr, q.data_ptr<float>(), hq * D},
               LinearJob{wk, bias_ptr(bk, hkv * D, kb_k), nullptr, k.data_ptr<float>(), hkv * D},
               LinearJob{wv, bias_ptr(bv, hkv * D, kb_v), nullptr, v.data_ptr<float>(), hkv * D}},
              precision);
  if (qn_w.has_value() && qn_w->defined()) {
    TORCH_CHECK(kn_w.has_value() && kn_w->defined(), "exact attn_in: q_norm without k_norm");
    q = rms_norm(q.reshape({-1, D}), *qn_w, q_eps);
    k = rms_norm(k.reshape({-1, D}), *kn_w, k_eps);
  }
  q = rope(q.reshape({batch, length, hq * D}), cos, sin, hq);
  k = rope(k.reshape({batch, length, hkv * D}), cos, sin, hkv);
  if (precision != Precision::fp32) {  // the bf16 modes hold keys and values at bf16 precision
    k = k.contiguous();
    round_to_bf16_(k);
    round_to_bf16_(v);
  }
  return {q, k, v.view({batch, length, hkv, D}).transpose(1, 2)};
}

}  // namespace

std::vector<torch::Tensor> attn_in(torch::Tensor x, torch::Tensor ln_w, double eps, torch::Tensor wq,
                                   c10::optional<torch::Tensor> bq, torch::Tensor wk, c10::optional<torch::Tensor> bk,
                                   torch::Tensor wv, c10::optional<torch::Tensor> bv,
                                   c10::optional<torch::Tensor> qn_w, c10::optional<torch::Tensor> kn_w, double q_eps, double k_eps,
                                   torch::Tensor cos, torch::Tensor sin, int64_t batch, int64_t length, int64_t hq,
                                   int64_t hkv) {
  return attn_in_impl(x, ln_w, eps, wq, bq, wk, bk, wv, bv, qn_w, kn_w, q_eps, k_eps, cos, sin, batch, length, hq, hkv,
                      Precision::fp32);
}

// attn_in with the q/k/v projections on the bf16 GEMM (the norms and the rotation stay float32), the keys (after
// the rotation) and values rounded to bf16 values (kv_bits): the exact-bf16 mode's KV cache holds bf16.
std::vector<torch::Tensor> attn_in_bf16(torch::Tensor x, torch::Tensor ln_w, double eps, torch::Tensor wq,
                                        c10::optional<torch::Tensor> bq, torch::Tensor wk,
                                        c10::optional<torch::Tensor> bk, torch::Tensor wv,
                                        c10::optional<torch::Tensor> bv, c10::optional<torch::Tensor> qn_w,
                                        c10::optional<torch::Tensor> kn_w, double q_eps, double k_eps, torch::Tensor cos,
                                        torch::Tensor sin, int64_t batch, int64_t length, int64_t hq, int64_t hkv) {
  return attn_in_impl(x, ln_w, eps, wq, bq, wk, bk, wv, bv, qn_w, kn_w, q_eps, k_eps, cos, sin, batch, length, hq, hkv,
                      Precision::bf16);
}

// Post-attention half: attention of q over the (updated) cache k, v, the output projection plus the residual,
// RMSNorm, the gate and up projections, SiLU gate, the down projection plus the residual. x [M, W] is the
// layer's input (the residual stream); returns the layer's output [M, W].
namespace {

// The layer's rest once its attention output a [M, Hq * D] is known (attn_out_impl, and the stack's packed rows).
torch::Tensor post_attention(torch::Tensor x, const torch::Tensor& a, torch::Tensor wo, c10::optional<torch::Tensor> bo,
                             torch::Tensor ln_w, double eps, torch::Tensor wg, c10::optional<torch::Tensor> bg,
                             torch::Tensor wu, c10::optional<torch::Tensor> bu, torch::Tensor wd,
                             c10::optional<torch::Tensor> bd, Precision precision) {
  TORCH_CHECK(wo.scalar_type() == at::kFloat && wg.scalar_type() == at::kFloat && wu.scalar_type() == at::kFloat &&
                  wd.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat,
              "exact attn_out: float32 only");
  x = x.contiguous();
  const int64_t M = x.size(0), W = x.size(1), I = wg.size(0);
  TORCH_CHECK(wo.size(0) == W && wd.size(0) == W && wu.size(0) == I && wd.size(1) == I && wg.size(1) == W &&
                  wu.size(1) == W,
              "exact attn_out: weight shapes");
  TORCH_CHECK(a.size(0) == M && a.size(1) == wo.size(1) && a.is_contiguous(), "exact attn_out: o_proj width");
  auto x1 = torch::empty({M, W}, x.options());
  torch::Tensor keep_o, keep_g, keep_u, keep_d;
  run_linears(a.data_ptr<float>(), M, a.size(1),
              {LinearJob{wo, bias_ptr(bo, W, keep_o), x.data_ptr<float>(), x1.data_ptr<float>(), W}}, precision);
  const torch::Tensor h = rms_norm(x1, ln_w, eps);
  auto g = torch::empty({M, I}, x.options());
  auto u = torch::empty({M, I}, x.options());
  run_linears(h.data_ptr<float>(), M, W,
              {LinearJob{wg, bias_ptr(bg, I, keep_g), nullptr, g.data_ptr<float>(), I},
               LinearJob{wu, bias_ptr(bu, I, keep_u), nullptr, u.data_ptr<float>(), I}}, precision);
  const torch::Tensor s = silu_mul(g, u);
  auto x2 = torch::empty({M, W}, x.options());
  run_linears(s.data_ptr<float>(), M, I,
              {LinearJob{wd, bias_ptr(bd, W, keep_d), x1.data_ptr<float>(), x2.data_ptr<float>(), W}}, precision);
  return x2;
}

torch::Tensor attn_out_impl(torch::Tensor x, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask,
                            double scale, torch::Tensor wo, c10::optional<torch::Tensor> bo, torch::Tensor ln_w,
                            double eps, torch::Tensor wg, c10::optional<torch::Tensor> bg, torch::Tensor wu,
                            c10::optional<torch::Tensor> bu, torch::Tensor wd, c10::optional<torch::Tensor> bd,
                            Precision precision) {
  const torch::Tensor a = attention(q, k, v, mask, scale).reshape({x.size(0), -1}).contiguous();
  return post_attention(x, a, wo, bo, ln_w, eps, wg, bg, wu, bu, wd, bd, precision);
}

}  // namespace

torch::Tensor attn_out(torch::Tensor x, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask,
                       double scale, torch::Tensor wo, c10::optional<torch::Tensor> bo, torch::Tensor ln_w, double eps,
                       torch::Tensor wg, c10::optional<torch::Tensor> bg, torch::Tensor wu,
                       c10::optional<torch::Tensor> bu, torch::Tensor wd, c10::optional<torch::Tensor> bd) {
  return attn_out_impl(x, q, k, v, mask, scale, wo, bo, ln_w, eps, wg, bg, wu, bu, wd, bd, Precision::fp32);
}

// attn_out with the output, gate/up and down projections on the bf16 GEMM (attention, the norm, the SiLU gate and
// the residual adds stay float32).
torch::Tensor attn_out_bf16(torch::Tensor x, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask,
                            double scale, torch::Tensor wo, c10::optional<torch::Tensor> bo, torch::Tensor ln_w,
                            double eps, torch::Tensor wg, c10::optional<torch::Tensor> bg, torch::Tensor wu,
                            c10::optional<torch::Tensor> bu, torch::Tensor wd, c10::optional<torch::Tensor> bd) {
  return attn_out_impl(x, q, k, v, mask, scale, wo, bo, ln_w, eps, wg, bg, wu, bu, wd, bd, Precision::bf16);
}

