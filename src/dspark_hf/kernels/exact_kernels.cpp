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
//  * attention: per (batch, head, query) the scores of the visible keys (a dot product over D in chunks of 8 floats
//    into one 8-lane accumulator, a zero-padded last chunk, then a fixed horizontal sum of the 8 lanes), their maximum,
//    exp(s - max) with the C library's expf, the denominator summed over visible keys in ascending order, and
//    the weighted sum of values accumulated key by key in ascending order. Keys a query may not see are
//    skipped, so a query that sees the first L keys gets the same result whether the cache holds L or more, and
//    whatever other queries share the call: a prefill of any length, in one call or in chunks, computes each
//    query as decoding does. Queries are scored in groups of four against four keys at a time (one accumulator
//    per pair), which reads each key once per group instead of once per query.
//
//  * rms_norm, rope, silu_mul: the per-row steps of a decoder layer, for the exact mode's lean layer path.
//
// Compiled with -ffp-contract=off so that the compiler never fuses or reorders anything behind our back.

#include <ATen/Parallel.h>
#include <torch/extension.h>

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
            for (int64_t c = 0; c < cols; ++c) {
              float s = tmp[r * GNR + c];
              if (job.bias != nullptr) s = s + job.bias[n0 + c];
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
  std::vector<uint16_t> xb(static_cast<size_t>(M * 2 * K2));
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* src = xp + m * K;
      uint16_t* dst = xb.data() + m * 2 * K2;
      for (int64_t k = 0; k < K; ++k) dst[k] = bf16_bits(src[k]);
      if (K % 2 != 0) dst[K] = 0;
    }
  });
  const int64_t block_rows = std::max<int64_t>(GMR, (GEMM_BLOCK_BYTES / (K2 * 4)) / GMR * GMR);
  const bool native = precision == Precision::bf16 && bf16_native_build();
  run_panels(M, block_rows, jobs, first, [&](size_t j, int64_t p, int64_t m, int64_t R, float* tmp) {
    const uint16_t* panel = reinterpret_cast<const uint16_t*>(packs[j].data_ptr<at::BFloat16>()) + p * K2 * GNR * 2;
    const uint16_t* x = xb.data() + m * 2 * K2;
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

// The weighted sum of one query's values: over its visible keys j < jend in ascending order, p = exp(score - mx),
// denom += p and acc[d] = fma(p, v[j, d], acc[d]) for every d, then out[d] = acc[d] / denom. Every d is its own chain
// (a vector lane), so the vector width does not change a bit of it: NV vectors of GV lanes held in registers when the
// head dimension is NV * GV (64 or 128 on AVX-512), else (NV = 0) 8-lane vectors with a zero-padded tail in memory.
template <int NV>
inline void weighted_values(const float* scores, const char* seen, int64_t jend, float mx, const float* vb,
                            int64_t vstride, int64_t D, float* oi) {
  float denom = 0.f;
  if constexpr (NV > 0) {
    gvec acc[NV];
    for (int c = 0; c < NV; ++c) acc[c] = gzero();
    for (int64_t j = 0; j < jend; ++j) {
      if (!seen[j]) continue;
      const float p = std::exp(scores[j] - mx);
      denom = denom + p;
      const gvec pv = gset1(p);
      const float* vj = vb + j * vstride;
      for (int c = 0; c < NV; ++c) acc[c] = gfma(pv, gload(vj + c * GV), acc[c]);
    }
    alignas(64) float tmp[GV];
    for (int c = 0; c < NV; ++c) {
      gstore(tmp, acc[c]);
      for (int l = 0; l < GV; ++l) oi[c * GV + l] = tmp[l] / denom;
    }
  } else {
    const int64_t dv = (D + 7) / 8;
    vec8 acc[64];
    for (int64_t c = 0; c < dv; ++c) acc[c] = vzero();
    for (int64_t j = 0; j < jend; ++j) {
      if (!seen[j]) continue;
      const float p = std::exp(scores[j] - mx);
      denom = denom + p;
      const float* vj = vb + j * vstride;
#ifdef DSPARK_AVX2
      const vec8 pv = _mm256_set1_ps(p);
#else
      vec8 pv;
      for (int l = 0; l < 8; ++l) pv.v[l] = p;
#endif
      for (int64_t c = 0; c < dv; ++c) {
        const int64_t d0 = c * 8;
        const vec8 vv = (d0 + 8 <= D) ? vload(vj + d0) : vload_tail(vj + d0, D - d0);
        acc[c] = vfma(pv, vv, acc[c]);
      }
    }
    alignas(32) float tmp[8];
    for (int64_t c = 0; c < dv; ++c) {
      vstore(tmp, acc[c]);
      const int64_t d0 = c * 8;
      for (int64_t l = 0; l < 8 && d0 + l < D; ++l) oi[d0 + l] = tmp[l] / denom;
    }
  }
}

// q [B, Hq, Lq, D], k and v [B, Hkv, Lk, D] (any strides with a contiguous last dim), mask: empty (causal: query
// i sees keys 0 .. Lk - Lq + i) or bool broadcastable to [B, Hq, Lq, Lk] (true = may attend).
// Returns [B, Lq, Hq, D] (the layout transformers' attention functions return).
//
// Queries run in groups of QG consecutive ones of one (batch, head): the keys all of them may reach are scored as
// QG x 4 tiles (each query-key pair its own accumulator, the same operations as a pair scored alone), the rest
// query by query; only keys up to a query's last visible one are scored. Each query's softmax and weighted sum
// then run on its own, in ascending key order. Grouping, tiling and threads change which pairs are computed
// together, never the operations of one, so a query's output does not depend on the other queries in the call.
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "exact attention: float32 only");
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
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool* mp = has_mask ? m.data_ptr<bool>() : nullptr;
  const auto qs = q.strides(), ks = k.strides(), vs = v.strides();
  const int64_t ms0 = has_mask ? m.stride(0) : 0, ms1 = has_mask ? m.stride(1) : 0;
  const int64_t ms2 = has_mask ? m.stride(2) : 0, ms3 = has_mask ? m.stride(3) : 0;
  const float sc = static_cast<float>(scale);
  TORCH_CHECK((D + 7) / 8 <= 64, "exact attention: head_dim up to 512");
  constexpr int64_t QG = 4;
  const int64_t groups = (Lq + QG - 1) / QG;
  at::parallel_for(0, B * Hq * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(QG * Lk);
    std::vector<char> seen(QG * Lk);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / (Hq * groups), h = (idx / groups) % Hq, i0 = (idx % groups) * QG;
      const int64_t nq = std::min<int64_t>(QG, Lq - i0);
      const int64_t hk = h / rep;
      const float* kb = kp + b * ks[0] + hk * ks[1];
      const float* vb = vp + b * vs[0] + hk * vs[1];
      const float* qi[QG];
      int64_t jend[QG];
      int64_t jmin = Lk;
      for (int64_t r = 0; r < nq; ++r) {
        const int64_t i = i0 + r;
        qi[r] = qp + b * qs[0] + h * qs[1] + i * qs[2];
        char* sr = seen.data() + r * Lk;
        if (has_mask) {  // keys past the last one the mask allows are never visible
          const bool* mr = mp + b * ms0 + h * ms1 + i * ms2;
          int64_t e = Lk;
          while (e > 0 && !mr[(e - 1) * ms3]) --e;
          jend[r] = e;
          for (int64_t j = 0; j < e; ++j) sr[j] = mr[j * ms3];
        } else {  // causal over the cache
          jend[r] = std::max<int64_t>(0, std::min<int64_t>(Lk, Lk - Lq + i + 1));
          std::memset(sr, 1, jend[r]);
        }
        jmin = std::min(jmin, jend[r]);
      }
      // the raw dot products: QG queries x 4 keys where all of them reach, then each query's own rest four keys
      // at a time (independent accumulators, the same arithmetic per pair as one at a time)
      int64_t j0 = 0;
      if (nq == QG) {
        for (; j0 + 4 <= jmin; j0 += 4) {
          const float* ws[4] = {kb + j0 * ks[2], kb + (j0 + 1) * ks[2], kb + (j0 + 2) * ks[2], kb + (j0 + 3) * ks[2]};
          dot_tile<QG, 4>(qi, ws, D, scores.data() + j0, Lk, nullptr);
        }
      }
      for (int64_t r = 0; r < nq; ++r) {
        float* sr = scores.data() + r * Lk;
        const float* xs[1] = {qi[r]};
        int64_t j = j0;
        for (; j + 4 <= jend[r]; j += 4) {
          const float* ws[4] = {kb + j * ks[2], kb + (j + 1) * ks[2], kb + (j + 2) * ks[2], kb + (j + 3) * ks[2]};
          dot_tile<1, 4>(xs, ws, D, sr + j, 1, nullptr);
        }
        for (; j < jend[r]; ++j) {
          const float* ws[1] = {kb + j * ks[2]};
          dot_tile<1, 1>(xs, ws, D, sr + j, 1, nullptr);
        }
      }
      // per query: the scaled scores of the visible keys, their maximum, the weighted sum of values
      for (int64_t r = 0; r < nq; ++r) {
        float* sr = scores.data() + r * Lk;
        const char* seen_r = seen.data() + r * Lk;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < jend[r]; ++j) {
          if (!seen_r[j]) continue;
          const float s = sr[j] * sc;
          sr[j] = s;
          if (s > mx) mx = s;
        }
        float* oi = op + ((b * Lq + i0 + r) * Hq + h) * D;
        if (mx == -std::numeric_limits<float>::infinity()) {  // nothing visible (a fully padded row): zeros
          for (int64_t d = 0; d < D; ++d) oi[d] = 0.f;
          continue;
        }
        if (D == 4 * GV)
          weighted_values<4>(sr, seen_r, jend[r], mx, vb, vs[2], D, oi);
        else if (D == 8 * GV)
          weighted_values<8>(sr, seen_r, jend[r], mx, vb, vs[2], D, oi);
        else
          weighted_values<0>(sr, seen_r, jend[r], mx, vb, vs[2], D, oi);
      }
    }
  });
  return out;
}

// The small per-row operations of a decoder layer, so that the exact mode's lean layer path
// (dspark_hf/kernels/lean.py) runs them in one call each instead of several PyTorch operations. Like the
// kernels above, each output element depends only on its own row and is computed in a fixed order; they run
// on the calling thread (their work is far below what an OpenMP region's start-up costs).

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
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xp + m * N;
    const float* xs[1] = {row};
    float ss;
    dot_tile<1, 1>(xs, xs, N, &ss, 1, nullptr);
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(N) + e);
    float* o = op + m * N;
    for (int64_t n = 0; n < N; ++n) o[n] = wp[n] * (row[n] * r);
  }
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
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < L; ++l) {
      const int64_t cb = cos.size(0) == 1 ? 0 : b;
      const float* c = cp + (cb * L + l) * D;
      const float* s = sp + (cb * L + l) * D;
      for (int64_t h = 0; h < H; ++h) {
        const float* xi = xp + ((b * L + l) * H + h) * D;
        float* o = op + ((b * H + h) * L + l) * D;
        for (int64_t d = 0; d < half; ++d) o[d] = xi[d] * c[d] + (-xi[d + half]) * s[d];
        for (int64_t d = half; d < D; ++d) o[d] = xi[d] * c[d] + xi[d - half] * s[d];
      }
    }
  return out;
}

// SwiGLU's gate: out = silu(g) * u with silu(g) = g / (1 + exp(-g)), element by element.
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
  for (int64_t i = 0; i < n; ++i) op[i] = (gp[i] / (1.0f + std::exp(-gp[i]))) * up[i];
  return out;
}

// ------------------------------------------------------------------------------------------- fused decoder layer
// The exact mode's lean decoder-layer path (dspark_hf/kernels/lean.py) in two calls per layer, around the KV
// cache's update (which stays in Python): the same kernels as above, called in the same order on the same
// values, so the results are bit-identical to calling them one by one; what goes away is a dozen Python-level
// calls per layer and, with the projections sharing one parallel region, five of the seven fork/joins.

// Pre-attention half: RMSNorm, the q/k/v projections, Qwen3's per-head q/k RMSNorm when its weights are given,
// rotary embedding. x [M = B * L, W]; returns q [B, Hq, L, D], k [B, Hkv, L, D] and v [B, Hkv, L, D] (a view).
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

// attn_in with the q/k/v projections on the bf16 GEMM (the norms and the rotation stay float32).
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

torch::Tensor attn_out_impl(torch::Tensor x, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask,
                            double scale, torch::Tensor wo, c10::optional<torch::Tensor> bo, torch::Tensor ln_w,
                            double eps, torch::Tensor wg, c10::optional<torch::Tensor> bg, torch::Tensor wu,
                            c10::optional<torch::Tensor> bu, torch::Tensor wd, c10::optional<torch::Tensor> bd,
                            Precision precision) {
  TORCH_CHECK(wo.scalar_type() == at::kFloat && wg.scalar_type() == at::kFloat && wu.scalar_type() == at::kFloat &&
                  wd.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat,
              "exact attn_out: float32 only");
  x = x.contiguous();
  const int64_t M = x.size(0), W = x.size(1), I = wg.size(0);
  TORCH_CHECK(wo.size(0) == W && wd.size(0) == W && wu.size(0) == I && wd.size(1) == I && wg.size(1) == W &&
                  wu.size(1) == W,
              "exact attn_out: weight shapes");
  const torch::Tensor a = attention(q, k, v, mask, scale).reshape({M, -1});
  TORCH_CHECK(a.size(1) == wo.size(1), "exact attn_out: o_proj width");
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

