// Decoding attention on a CPU in bf16 and fp32; also RoPE with the cache write, the residual
// add with its RMSNorm, the greedy token of each row of logits (or of an fp32 lm_head
// screened through a bf16 one), the MLP's SiLU with its product (bf16), and products of a
// few fp32 rows with a packed weight (AVX2). Compiled on
// first use by cpu_kernels.py (torch's cpp_extension, -march=native); that module's
// docstring says why each exists. ATen's tensor headers only (torch/extension.h took a
// compiler ~8x as long to read): Python's bindings are in cpu_kernels_bindings.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// One (row, KV head, block of new tokens) of a batch: up to 16 query rows (each query
// head of the group at each token of the block) over the row's first S slots. scores has
// room for 16 x stride floats. T: the cache's element, bf16 bits (uint16_t) or float.
template <typename T>
struct Item {
  const T* q[16];            // each query row's D values
  const bool* visible[16];   // each query row's visible slots (its token's)
  T* out[16];                // each query row's D outputs
  const T* keys;
  const T* values;
  const Item* next = nullptr;  // the item this thread attends next, or nullptr
  bool fetched = false;        // whether the item before fetched this one's own slots
  int64_t R, S, D, ks, vs;
  float scale;
  // The row's first P slots as a shared prefix holds them (the same bits as the row's own
  // copy): read there, where every row of the batch finds them in cache. P = 0: none.
  const T* pkeys = nullptr;
  const T* pvalues = nullptr;
  int64_t P = 0, pks = 0, pvs = 0;
  const T* key(int64_t s) const { return s < P ? pkeys + s * pks : keys + s * ks; }
  const T* value(int64_t s) const { return s < P ? pvalues + s * pvs : values + s * vs; }
  // The block of up to `width` slots from s ends where the shared prefix does, so that its
  // keys lie in one place: key(s) on, key_step(s) apart.
  int64_t block(int64_t s, int64_t width) const {
    return std::min(width, (s < P ? std::min(P, S) : S) - s);
  }
  int64_t key_step(int64_t s) const { return s < P ? pks : ks; }
  // f(base, step, begin, end) over the values' slots: the shared prefix's, then the row's
  // own (one order of additions either way).
  template <typename F>
  void value_spans(F&& f) const {
    const int64_t shared = std::min(P, S);
    f(pvalues, pvs, 0, shared);
    f(values, vs, shared, S);
  }
};

static inline float widen1(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float y;
  std::memcpy(&y, &bits, 4);
  return y;
}

static inline uint16_t narrow1(float x) {  // round to nearest even, as torch's .to(bf16)
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if (std::isnan(x)) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

static inline float widen1(float x) { return x; }
static inline void store1(float x, uint16_t* y) { *y = narrow1(x); }
static inline void store1(float x, float* y) { *y = x; }

// Any CPU, any head size: plain loops.
template <typename T>
static void attend_plain(const Item<T>& it, float* scores, int64_t stride) {
  const int64_t D = it.D, S = it.S;
  std::vector<float> acc(D);
  for (int64_t r = 0; r < it.R; ++r) {
    float* sr = scores + r * stride;
    const bool* mr = it.visible[r];
    float peak = -INFINITY, sum = 0.f;
    for (int64_t s = 0; s < S; ++s) {
      const T* kr = it.keys + s * it.ks;
      float a = 0.f;
      for (int64_t d = 0; d < D; ++d) a += widen1(it.q[r][d]) * widen1(kr[d]);
      sr[s] = mr[s] ? a * it.scale : -INFINITY;
      peak = std::max(peak, sr[s]);
    }
    for (int64_t s = 0; s < S; ++s) {
      sr[s] = mr[s] ? std::exp(sr[s] - peak) : 0.f;
      sum += sr[s];
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t s = 0; s < S; ++s) {
      const T* vr = it.values + s * it.vs;
      for (int64_t d = 0; d < D; ++d) acc[d] += sr[s] * widen1(vr[d]);
    }
    for (int64_t d = 0; d < D; ++d) store1(acc[d] / sum, it.out[r] + d);
  }
}

#if defined(__AVX2__) || defined(__AVX512F__)
// An item's own keys or values (its slots past the shared prefix) fetched into L2 a few
// slots at a time while the item before computes: `per` slots a call, so that `calls`
// calls fetch them all. Of no item (nullptr, a thread's last): fetches nothing.
template <typename T>
struct Ahead {
  const T* base = nullptr;
  int64_t step = 0, slot = 0, end = 0, per = 0, D = 0;
  static Ahead keys(const Item<T>* it, int64_t calls) {
    return it == nullptr ? Ahead() : Ahead(it->keys, it->ks, *it, calls);
  }
  static Ahead values(const Item<T>* it, int64_t calls) {
    return it == nullptr ? Ahead() : Ahead(it->values, it->vs, *it, calls);
  }
  void fetch() {
    for (int64_t n = 0; n < per && slot < end; ++n, ++slot)
      for (int64_t d = 0; d < D; d += 64 / static_cast<int64_t>(sizeof(T)))
        _mm_prefetch(reinterpret_cast<const char*>(base + slot * step + d), _MM_HINT_T1);
  }

 private:
  Ahead() = default;
  Ahead(const T* base_, int64_t step_, const Item<T>& it, int64_t calls)
      : base(base_), step(step_), slot(std::min(it.P, it.S)), end(it.S), D(it.D) {
    per = (end - slot + calls - 1) / std::max<int64_t>(1, calls);
  }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
// 8 vectors in, one out: lane j is the sum of v[j]'s 8 lanes.
static inline __m256 sum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// exp(x) for x <= 0 (scores less their peak): Cephes' expf polynomial, as exp16 below.
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Query row q's dot products with the n (<= 8) keys from k0, lane sums in dots[j]. D goes
// in chunks of 64 (a head of 64: one): the chunk of q in 8 registers, each key's lanes
// straight from memory into its FMA. Loading q again for every key, the loop was bound
// by loads: with the lane mask below, an 80-row step's attention on the AVX2 EPYC went
// from 15.7 to 12.4 ms with its keys in cache, ~5% less from memory (BENCHMARKS.md).
// Each sum adds in the same order as before.
static inline void dots8(const float* q, const float* k0, int64_t ks, int64_t D, int64_t n,
                         __m256* dots) {
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) dots[j] = _mm256_setzero_ps();
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t width = std::min<int64_t>(64, D - d0);  // a multiple of 16
    __m256 qs[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c)
      qs[c] = c * 8 < width ? _mm256_loadu_ps(q + d0 + c * 8) : _mm256_setzero_ps();
    if (n == 8 && width == 64) {  // the common case, fully unrolled
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c)
          dots[j] = _mm256_fmadd_ps(qs[c], _mm256_loadu_ps(k0 + j * ks + d0 + c * 8), dots[j]);
      continue;
    }
    for (int j = 0; j < n; ++j)
      for (int c = 0; c * 8 < width; ++c)
        dots[j] = _mm256_fmadd_ps(qs[c], _mm256_loadu_ps(k0 + j * ks + d0 + c * 8), dots[j]);
  }
}

// The weighted sum of the values for query rows r0.. (ROWS of them) and outputs c0..c0+8 *
// CHUNKS: sums kept in registers, only as many rows as there are.
template <int ROWS, int CHUNKS>
static inline void weigh_fp32(const Item<float>& it, const float* scores, int64_t stride,
                              const float* norm, int64_t r0, int64_t c0, Ahead<float>* ahead) {
  __m256 sums[ROWS][CHUNKS];
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < CHUNKS; ++c) sums[r][c] = _mm256_setzero_ps();
  const float* p0 = scores + r0 * stride;
  const auto span = [&](const float* base, int64_t step, int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      if (ahead != nullptr) ahead->fetch();
      const float* vr = base + s * step + c0;
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        const __m256 p = _mm256_broadcast_ss(p0 + r * stride + s);
#pragma GCC unroll 4
        for (int c = 0; c < CHUNKS; ++c)
          sums[r][c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * c), sums[r][c]);
      }
    }
  };
  it.value_spans(span);
  for (int r = 0; r < ROWS; ++r) {
    const __m256 scale = _mm256_set1_ps(norm[r0 + r]);
#pragma GCC unroll 4
    for (int c = 0; c < CHUNKS; ++c)
      _mm256_storeu_ps(it.out[r0 + r] + c0 + 8 * c, _mm256_mul_ps(sums[r][c], scale));
  }
}

// fp32, head size a multiple of 16 (AVX2 and FMA): 8 slots' scores at a time; for the
// weighted sum up to 3 query rows x 32 outputs (4 rows x 16) kept in registers.
static void attend_fp32(const Item<float>& it, float* scores, int64_t stride) {
  const int64_t S = it.S, D = it.D;
  const __m256 neg = _mm256_set1_ps(-INFINITY);
  float norm[16];
  __m256 peaks[16];
  for (int64_t r = 0; r < it.R; ++r) peaks[r] = neg;
  // Block by block, every query row: a block's keys are read from memory once and stay in
  // L1 for the other rows (row by row, a head's keys went through L2 once a row).
  // the next item's keys over this one's blocks, its values over this one's weighted sum
  // (attend_wide says why)
  auto keys_ahead = Ahead<float>::keys(it.next, (S + 7) / 8);
  auto values_ahead = Ahead<float>::values(it.next, S);
  for (int64_t s0 = 0, n; s0 < S; s0 += n) {
    n = it.block(s0, 8);
    const float* k0 = it.key(s0);
    const int64_t kstep = it.key_step(s0);
    // The first item of a thread, fetched by none: the keys four blocks on and this block's
    // values, ahead of their use: an 80-row fp32 round went from 188 to 166 ms on the AMX
    // Xeon (2026-12-03).
    if (!it.fetched)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < D; d += 16) {
          if (s0 + 32 + j < S)
            _mm_prefetch(reinterpret_cast<const char*>(it.key(s0 + 32 + j) + d), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(it.value(s0 + j) + d), _MM_HINT_T0);
        }
    keys_ahead.fetch();
    for (int64_t r = 0; r < it.R; ++r) {
      const bool* mr = it.visible[r];
      __m256 dots[8];
      dots8(it.q[r], k0, kstep, D, n, dots);
      __m256 xv = _mm256_mul_ps(sum8(dots), _mm256_set1_ps(it.scale));
      if (n == 8) {  // the block's 8 visibility bytes as a lane mask, no scalar round trip
        const __m256i seen = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mr + s0)));
        xv = _mm256_blendv_ps(
            xv, neg, _mm256_castsi256_ps(_mm256_cmpeq_epi32(seen, _mm256_setzero_si256())));
      } else {
        alignas(32) float x[8];
        _mm256_store_ps(x, xv);
        for (int j = 0; j < 8; ++j) x[j] = j < n && mr[s0 + j] ? x[j] : -INFINITY;
        xv = _mm256_load_ps(x);
      }
      _mm256_storeu_ps(scores + r * stride + s0, xv);
      peaks[r] = _mm256_max_ps(peaks[r], xv);
    }
  }
  for (int64_t r = 0; r < it.R; ++r) {
    float* sr = scores + r * stride;
    // past S to the next multiple of 8: nothing (after a short block at the prefix's end,
    // the last block need not end on one)
    _mm256_storeu_ps(sr + S, neg);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, peaks[r]);
    const __m256 top = _mm256_set1_ps(*std::max_element(lanes, lanes + 8));
    __m256 total = _mm256_setzero_ps();
    for (int64_t s0 = 0; s0 < S; s0 += 8) {
      const __m256 x = _mm256_loadu_ps(sr + s0);
      const __m256 seen = _mm256_cmp_ps(x, neg, _CMP_NEQ_OQ);
      const __m256 e = _mm256_and_ps(seen, exp8(_mm256_sub_ps(x, top)));
      _mm256_storeu_ps(sr + s0, e);  // lanes past S: zero (seen excludes them)
      total = _mm256_add_ps(total, e);
    }
    _mm256_store_ps(lanes, total);
    float sum = 0.f;
    for (int j = 0; j < 8; ++j) sum += lanes[j];
    norm[r] = 1.f / sum;
  }
  for (int64_t r0 = 0; r0 < it.R; r0 += 4) {
    const int64_t rows = std::min<int64_t>(4, it.R - r0);  // 3 for one token of 3 heads
    const int64_t width = rows < 4 && D % 32 == 0 ? 32 : 16;
    for (int64_t c0 = 0; c0 < D; c0 += width) {
      Ahead<float>* a = r0 == 0 && c0 == 0 ? &values_ahead : nullptr;
      if (rows == 4) weigh_fp32<4, 2>(it, scores, stride, norm, r0, c0, a);
      else if (rows == 3 && width == 32) weigh_fp32<3, 4>(it, scores, stride, norm, r0, c0, a);
      else if (rows == 3) weigh_fp32<3, 2>(it, scores, stride, norm, r0, c0, a);
      else if (rows == 2 && width == 32) weigh_fp32<2, 4>(it, scores, stride, norm, r0, c0, a);
      else if (rows == 2) weigh_fp32<2, 2>(it, scores, stride, norm, r0, c0, a);
      else if (width == 32) weigh_fp32<1, 4>(it, scores, stride, norm, r0, c0, a);
      else weigh_fp32<1, 2>(it, scores, stride, norm, r0, c0, a);
    }
  }
}
#endif

#if defined(__AVX512F__)
// 16 vectors in, one out: lane j is the sum of v[j]'s 16 lanes (a transpose-add).
static inline __m512 sum16(const __m512* v) {
  __m512 pairs[8], quads[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
  const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xdd));
}

static inline __m512 widen16(const uint16_t* x) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) for x <= 0 (scores less their peak): Cephes' expf polynomial, 2^n by scalef.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// 16 of a row's values as fp32, and 16 fp32 outputs stored as the cache's element (bf16
// rounds to nearest even, as torch's .to(bf16)).
static inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
static inline __m512 load16(const uint16_t* x) { return widen16(x); }
static inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
#if defined(__AVX512BF16__)
static inline void store16(uint16_t* y, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

// Query row q's dot products with the n (<= 16) keys from k0, lane sums in dots[j]: fp32
// FMA, or bf16 pairs multiplied into fp32 sums (vdpbf16ps).
static inline void dots16(const float* q, const float* k0, int64_t ks, int64_t D, int64_t n,
                          __m512* dots) {
  for (int64_t c = 0; c < D / 16; ++c) {
    const __m512 qc = _mm512_loadu_ps(q + 16 * c);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j)
      if (j < n) dots[j] = _mm512_fmadd_ps(_mm512_loadu_ps(k0 + j * ks + 16 * c), qc, dots[j]);
  }
}
#if defined(__AVX512BF16__)
static inline void dots16(const uint16_t* q, const uint16_t* k0, int64_t ks, int64_t D,
                          int64_t n, __m512* dots) {
  for (int64_t c = 0; c < D / 32; ++c) {
    const __m512bh qc = (__m512bh)_mm512_loadu_si512(q + 32 * c);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j)
      if (j < n)
        dots[j] = _mm512_dpbf16_ps(dots[j], (__m512bh)_mm512_loadu_si512(k0 + j * ks + 32 * c),
                                   qc);
  }
}
#endif

// The weighted sum of the values for query rows r0.. (ROWS of them) and outputs c0..c0+64,
// sums in fp32 registers.
template <int ROWS, typename T>
static inline void weigh_wide(const Item<T>& it, const float* scores, int64_t stride,
                              const float* norm, int64_t r0, int64_t c0, Ahead<T>* ahead) {
  __m512 sums[ROWS][4];
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) sums[r][c] = _mm512_setzero_ps();
  const float* p0 = scores + r0 * stride;
  const auto span = [&](const T* base, int64_t step, int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      if (ahead != nullptr) ahead->fetch();
      const T* vr = base + s * step + c0;
      __m512 v[4];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) v[c] = load16(vr + 16 * c);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        const __m512 p = _mm512_set1_ps(p0[r * stride + s]);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) sums[r][c] = _mm512_fmadd_ps(p, v[c], sums[r][c]);
      }
    }
  };
  it.value_spans(span);
  for (int r = 0; r < ROWS; ++r) {
    const __m512 scale = _mm512_set1_ps(norm[r0 + r]);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)
      store16(it.out[r0 + r] + c0 + 16 * c, _mm512_mul_ps(sums[r][c], scale));
  }
}

// AVX-512, head size a multiple of 64, bf16 (with AVX512-BF16) or fp32: 16 slots' scores
// at a time, up to 4 query rows x 64 outputs kept in registers; scores, softmax and the
// weighted sum in fp32. Half the instructions of attend_fp32's 8-lane loops.
template <typename T>
static void attend_wide(const Item<T>& it, float* scores, int64_t stride) {
  const int64_t S = it.S, D = it.D, line = 64 / static_cast<int64_t>(sizeof(T));
  const __m512 neg = _mm512_set1_ps(-INFINITY);
  float norm[16];
  __m512 peaks[16];
  for (int64_t r = 0; r < it.R; ++r) peaks[r] = neg;
  // the next item's keys over this one's blocks, its values over this one's weighted sum
  auto keys_ahead = Ahead<T>::keys(it.next, (S + 15) / 16);
  auto values_ahead = Ahead<T>::values(it.next, S);
  // Block by block, every query row (as attend_fp32: a block's keys stay in L1).
  for (int64_t s0 = 0, n; s0 < S; s0 += n) {
    n = it.block(s0, 16);
    const T* k0 = it.key(s0);
    const int64_t kstep = it.key_step(s0);
    // Ahead of their use. Each item fetches the next one's keys into L2 over its blocks and
    // the next one's values over its weighted sum, at a steady rate: fetched in bursts (the
    // next keys and this item's values during the scores alone, then nothing), the
    // reads waited on free fill buffers and overlapped little with the arithmetic
    // (bf16 and fp32 at 80 rows x 165 slots: -13% and -19% against that; BENCHMARKS.md,
    // "Attention's prefetches, spread"). The first item of a thread, fetched by none,
    // takes its keys two blocks on into L1 and its values into L2.
    if (!it.fetched) {
      for (int64_t j = 0; j < n && s0 + 32 + j < S; ++j)
        for (int64_t d = 0; d < D; d += line)
          _mm_prefetch(reinterpret_cast<const char*>(it.key(s0 + 32 + j) + d), _MM_HINT_T0);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < D; d += line)
          _mm_prefetch(reinterpret_cast<const char*>(it.value(s0 + j) + d), _MM_HINT_T1);
    }
    keys_ahead.fetch();
    const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t r = 0; r < it.R; ++r) {
      __m512 dots[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) dots[j] = _mm512_setzero_ps();
      dots16(it.q[r], k0, kstep, D, n, dots);
      const __m128i seen = _mm_maskz_loadu_epi8(lanes, it.visible[r] + s0);
      const __mmask16 vis = _mm512_test_epi32_mask(_mm512_cvtepu8_epi32(seen),
                                                   _mm512_set1_epi32(0xff));
      const __m512 x = _mm512_mask_mul_ps(neg, vis, sum16(dots), _mm512_set1_ps(it.scale));
      _mm512_storeu_ps(scores + r * stride + s0, x);
      peaks[r] = _mm512_max_ps(peaks[r], x);
    }
  }
  for (int64_t r = 0; r < it.R; ++r) {
    float* sr = scores + r * stride;
    // past S to the next multiple of 16: nothing (after a short block at the prefix's end,
    // the last block need not end on one)
    _mm512_storeu_ps(sr + S, neg);
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(peaks[r]));
    __m512 total = _mm512_setzero_ps();
    for (int64_t s0 = 0; s0 < S; s0 += 16) {
      const __m512 x = _mm512_loadu_ps(sr + s0);
      const __mmask16 vis = _mm512_cmp_ps_mask(x, neg, _CMP_NEQ_OQ);
      const __m512 e = _mm512_maskz_mov_ps(vis, exp16(_mm512_sub_ps(x, top)));
      _mm512_storeu_ps(sr + s0, e);  // lanes past S: zero (vis excludes them)
      total = _mm512_add_ps(total, e);
    }
    norm[r] = 1.f / _mm512_reduce_add_ps(total);
  }
  for (int64_t r0 = 0; r0 < it.R; r0 += 4) {
    const int64_t rows = std::min<int64_t>(4, it.R - r0);  // 3 for one token of 3 heads
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
      Ahead<T>* a = r0 == 0 && c0 == 0 ? &values_ahead : nullptr;
      if (rows == 4) weigh_wide<4>(it, scores, stride, norm, r0, c0, a);
      else if (rows == 3) weigh_wide<3>(it, scores, stride, norm, r0, c0, a);
      else if (rows == 2) weigh_wide<2>(it, scores, stride, norm, r0, c0, a);
      else weigh_wide<1>(it, scores, stride, norm, r0, c0, a);
    }
  }
}
#endif

// One past the last true of row[0..n): eight bytes at a time from the end (a short row of
// a long batch is mostly false after its end).
static int64_t visible_end(const bool* row, int64_t n) {
  int64_t s = n;
  for (uint64_t word; s >= 8; s -= 8) {
    std::memcpy(&word, row + s - 8, 8);
    if (word != 0) break;
  }
  while (s > 0 && !row[s - 1]) --s;
  return s;
}

// q [B, T, H, D] (any strides, D contiguous); keys, values [B, KV, S, D] (D contiguous);
// all bf16 or all fp32; visible [B, T, S] bool. Query head h reads KV head h / (H / KV),
// as transformers' repeat_kv maps them. Returns [B, T, H * D] in q's dtype: what the
// output projection takes. Scores, softmax and the weighted sum are fp32. Many new tokens
// (a prefill, a large tree) go in blocks of 16 / G, each block up to its last visible slot.
template <typename T>
static void attend_all(at::Tensor q, at::Tensor keys, at::Tensor values,
                       at::Tensor visible, double scale, at::Tensor out,
                       const c10::optional<at::Tensor>& prefix_keys,
                       const c10::optional<at::Tensor>& prefix_values,
                       const c10::optional<at::Tensor>& prefix_lens) {
  const int64_t B = q.size(0), T_ = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t KV = keys.size(1), Sall = keys.size(2), G = H / KV;
  const int64_t block = 16 / G, blocks = (T_ + block - 1) / block;
  const auto* qp = reinterpret_cast<const T*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const T*>(keys.data_ptr());
  const auto* vp = reinterpret_cast<const T*>(values.data_ptr());
  auto* op = reinterpret_cast<T*>(out.data_ptr());
  const bool* mp = visible.data_ptr<bool>();
  // The vector kernel for T on this CPU, where there is one: attend_wide (AVX-512; bf16
  // needs AVX512-BF16), else attend_fp32 (AVX2) for fp32.
  bool wide = false, vector = false;
#if defined(__AVX512BF16__)
  wide = std::is_same<T, uint16_t>::value && D % 64 == 0;
#endif
#if defined(__AVX512F__)
  wide = wide || (std::is_same<T, float>::value && D % 64 == 0);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  vector = std::is_same<T, float>::value && D % 16 == 0;
#endif
  // A shared prefix [KV, P, D] and each row's slots that hold it, read there by the vector
  // kernels (attend_plain reads the row's own copy: the same bits).
  const T* pk = nullptr;
  const T* pv = nullptr;
  const int64_t* plens = nullptr;
  if ((wide || vector) && prefix_keys.has_value()) {
    pk = reinterpret_cast<const T*>(prefix_keys->data_ptr());
    pv = reinterpret_cast<const T*>(prefix_values->data_ptr());
    plens = prefix_lens->data_ptr<int64_t>();
  }
  // each new token's slots up to its last visible one, found once for all its heads
  std::vector<int64_t> spans(B * T_);
  at::parallel_for(0, B * T_, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) spans[n] = visible_end(mp + n * Sall, Sall);
  });
  const int64_t items = B * KV * blocks;
  // first, last, second, second to last...: the decoder sorts rows longest first, and
  // each thread's contiguous share of items should hold long and short rows alike
  const auto order = [items](int64_t n) { return n % 2 == 0 ? n / 2 : items - 1 - n / 2; };
  const auto keys_of = [&](int64_t i) {
    return kp + i / (KV * blocks) * keys.stride(0) + i / blocks % KV * keys.stride(1);
  };
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    const int64_t stride = Sall + 16;
    std::vector<float> scores(16 * stride, 0.f);
    const auto make = [&](int64_t n) {
      const int64_t i = order(n);
      const int64_t b = i / (KV * blocks), h = i / blocks % KV, t0 = i % blocks * block;
      const int64_t tokens = std::min(block, T_ - t0);
      Item<T> it;
      it.keys = keys_of(i);
      it.values = vp + b * values.stride(0) + h * values.stride(1);
      it.R = G * tokens, it.D = D, it.scale = static_cast<float>(scale);
      it.ks = keys.stride(2), it.vs = values.stride(2);
      if (plens != nullptr && plens[b] > 0) {
        it.pkeys = pk + h * prefix_keys->stride(0);
        it.pvalues = pv + h * prefix_values->stride(0);
        it.P = plens[b], it.pks = prefix_keys->stride(1), it.pvs = prefix_values->stride(1);
      }
      it.S = 0;  // up to the block's last visible slot (rows differ in length)
      for (int64_t r = 0; r < it.R; ++r) {  // row r: query head h * G + r / tokens
        const int64_t t = t0 + r % tokens, head = h * G + r / tokens;
        it.q[r] = qp + b * q.stride(0) + t * q.stride(1) + head * q.stride(2);
        it.out[r] = op + (b * T_ + t) * H * D + head * D;
        it.visible[r] = mp + (b * T_ + t) * Sall;
        it.S = std::max(it.S, spans[b * T_ + t]);
      }
      return it;
    };
    Item<T> it = make(begin), next;
    for (int64_t n = begin; n < end; ++n) {
      if (n > begin) it = next, it.fetched = wide || vector;
      if (n + 1 < end) next = make(n + 1);
      it.next = n + 1 < end ? &next : nullptr;
      if (wide) {
#if defined(__AVX512BF16__)
        attend_wide(it, scores.data(), stride);
#elif defined(__AVX512F__)
        if constexpr (std::is_same<T, float>::value) attend_wide(it, scores.data(), stride);
#endif
        continue;
      }
      if (vector) {
#if defined(__AVX2__) && defined(__FMA__)
        if constexpr (std::is_same<T, float>::value) attend_fp32(it, scores.data(), stride);
#endif
        continue;
      }
      attend_plain(it, scores.data(), stride);
    }
  });
}

// prefix_keys, prefix_values [KV, P, D] (D contiguous) and prefix_lens [B] int64: row b's
// first prefix_lens[b] slots hold the prefix's (a shared system prompt copied into every
// row); all three or none.
at::Tensor decode_attention(at::Tensor q, at::Tensor keys, at::Tensor values, at::Tensor visible,
                            double scale, c10::optional<at::Tensor> prefix_keys,
                            c10::optional<at::Tensor> prefix_values,
                            c10::optional<at::Tensor> prefix_lens) {
  const int64_t H = q.size(2), KV = keys.size(1);
  TORCH_CHECK(H / KV <= 16, "at most 16 query heads per KV head, got ", H / KV);
  TORCH_CHECK(keys.scalar_type() == q.scalar_type() && values.scalar_type() == q.scalar_type(),
              "q, keys and values must share a dtype");
  TORCH_CHECK(prefix_keys.has_value() == prefix_values.has_value() &&
                  prefix_keys.has_value() == prefix_lens.has_value(),
              "prefix keys, values and lengths: all three or none");
  if (prefix_keys.has_value()) {
    TORCH_CHECK(prefix_keys->scalar_type() == q.scalar_type() &&
                    prefix_values->scalar_type() == q.scalar_type(),
                "the prefix must share q's dtype");
    TORCH_CHECK(prefix_keys->dim() == 3 && prefix_keys->size(0) == KV &&
                    prefix_keys->stride(2) == 1 &&
                    prefix_values->sizes() == prefix_keys->sizes() &&
                    prefix_values->stride(2) == 1,
                "the prefix: keys and values [KV, P, D], D contiguous");
    TORCH_CHECK(prefix_lens->scalar_type() == at::kLong && prefix_lens->is_contiguous() &&
                    prefix_lens->numel() == q.size(0),
                "prefix_lens: [B] int64");
    const int64_t* lens = prefix_lens->data_ptr<int64_t>();
    for (int64_t b = 0; b < prefix_lens->numel(); ++b)
      TORCH_CHECK(lens[b] >= 0 && lens[b] <= prefix_keys->size(1),
                  "row ", b, " holds ", lens[b], " slots of a prefix of ", prefix_keys->size(1));
  }
  auto out = at::empty({q.size(0), q.size(1), H * q.size(3)}, q.options());
  if (q.scalar_type() == at::kFloat)
    attend_all<float>(q, keys, values, visible, scale, out, prefix_keys, prefix_values,
                      prefix_lens);
  else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "bf16 or fp32, got ", q.scalar_type());
    attend_all<uint16_t>(q, keys, values, visible, scale, out, prefix_keys, prefix_values,
                         prefix_lens);
  }
  return out;
}

// What a value becomes when stored as T: bf16 rounds (to nearest even), fp32 keeps it.
static inline float stored(float x, const uint16_t*) { return widen1(narrow1(x)); }
static inline float stored(float x, const float*) { return x; }

// x (+ delta) [N, H] and RMSNorm of the sum, as torch computes them in x's dtype: the sum
// stored as T; rstd = 1 / sqrt(sum(s^2) / H + eps) and y = T(s * rstd * weight) in fp32.
// Writes sum (unless delta is null: then the sum is x) and y.
template <typename T>
static void add_rms_norm_rows(const T* xp, const T* dp, const T* wp, T* sp, T* yp, int64_t N,
                              int64_t H, float eps) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t i = begin; i < end; ++i) {
      const T* xr = xp + i * H;
      float squares = 0.f;
      if (dp != nullptr) {
        const T* dr = dp + i * H;
        T* sr = sp + i * H;
        for (int64_t d = 0; d < H; ++d) {
          const float v = stored(widen1(xr[d]) + widen1(dr[d]), xr);
          store1(v, sr + d);
          row[d] = v;
          squares += v * v;
        }
      } else {
        for (int64_t d = 0; d < H; ++d) {
          row[d] = widen1(xr[d]);
          squares += row[d] * row[d];
        }
      }
      const float rstd = 1.f / std::sqrt(squares / static_cast<float>(H) + eps);
      T* yr = yp + i * H;
      for (int64_t d = 0; d < H; ++d) store1(row[d] * rstd * widen1(wp[d]), yr + d);
    }
  });
}

// Returns (sum, y); the sum is x itself when delta is undefined. bf16 or fp32.
std::vector<at::Tensor> add_rms_norm(at::Tensor x, c10::optional<at::Tensor> delta,
                                     at::Tensor weight, double eps) {
  x = x.contiguous();
  const int64_t H = x.size(-1), N = x.numel() / H;
  at::Tensor sum = x, dc;
  if (delta.has_value()) {
    TORCH_CHECK(delta->sizes() == x.sizes(), "delta must be shaped as x");
    sum = at::empty_like(x);
    dc = delta->contiguous();
  }
  auto y = at::empty_like(x);
  auto wc = weight.contiguous();
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_rows<float>(x.data_ptr<float>(), dc.defined() ? dc.data_ptr<float>() : nullptr,
                             wc.data_ptr<float>(), sum.data_ptr<float>(), y.data_ptr<float>(),
                             N, H, e);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "bf16 or fp32, got ", x.scalar_type());
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    add_rms_norm_rows<uint16_t>(bits(x), dc.defined() ? bits(dc) : nullptr, bits(wc), bits(sum),
                                bits(y), N, H, e);
  }
  return {sum, y};
}

// RoPE of one head's D values as transformers applies it in T, each product and the sum
// stored as T: y = x * cos + rotate_half(x) * sin.
template <typename T>
static void rope_head(const T* x, const T* c, const T* s, T* y, int64_t D) {
  const int64_t half = D / 2;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<T, uint16_t>::value) {
    if (half % 16 == 0) {
      auto round = [](__m512 v) {
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
      };
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 other = d < half
                                 ? _mm512_xor_ps(widen16(x + d + half), _mm512_set1_ps(-0.f))
                                 : widen16(x + d - half);
        const __m512 sum = _mm512_add_ps(round(_mm512_mul_ps(widen16(x + d), widen16(c + d))),
                                         round(_mm512_mul_ps(other, widen16(s + d))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + d),
                            (__m256i)_mm512_cvtneps_pbh(sum));
      }
      return;
    }
  }
#endif
  for (int64_t d = 0; d < half; ++d) {  // two loops, each one the compiler vectorises
    const float a = stored(widen1(x[d]) * widen1(c[d]), x);
    const float b = stored(-widen1(x[d + half]) * widen1(s[d]), x);
    store1(a + b, y + d);
  }
  for (int64_t d = half; d < D; ++d) {
    const float a = stored(widen1(x[d]) * widen1(c[d]), x);
    const float b = stored(widen1(x[d - half]) * widen1(s[d]), x);
    store1(a + b, y + d);
  }
}

template <typename T>
static void rope_write(at::Tensor mixed, at::Tensor cos, at::Tensor sin,
                       at::Tensor keys, at::Tensor values, at::Tensor slots,
                       at::Tensor q, int64_t heads) {
  const int64_t B = mixed.size(0), T_ = mixed.size(1), KV = keys.size(1), D = keys.size(3);
  const int64_t width = (heads + 2 * KV) * D;
  const auto* mp = reinterpret_cast<const T*>(mixed.data_ptr());
  const auto* cp = reinterpret_cast<const T*>(cos.data_ptr());
  const auto* sp = reinterpret_cast<const T*>(sin.data_ptr());
  const int64_t* slot = slots.data_ptr<int64_t>();
  auto* qp = reinterpret_cast<T*>(q.data_ptr());
  auto* kp = reinterpret_cast<T*>(keys.data_ptr());
  auto* vp = reinterpret_cast<T*>(values.data_ptr());
  const int64_t kb = keys.stride(0), kh = keys.stride(1), ks = keys.stride(2);
  const int64_t vb = values.stride(0), vh = values.stride(1), vs = values.stride(2);
  at::parallel_for(0, B * T_, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / T_, at = slot[i];
      const T* row = mp + i * width;
      const T *c = cp + i * D, *s = sp + i * D;
      for (int64_t h = 0; h < heads; ++h) rope_head(row + h * D, c, s, qp + (i * heads + h) * D, D);
      for (int64_t h = 0; h < KV; ++h) {
        rope_head(row + (heads + h) * D, c, s, kp + b * kb + h * kh + at * ks, D);
        std::memcpy(vp + b * vb + h * vh + at * vs, row + (heads + KV + h) * D, D * sizeof(T));
      }
    }
  });
}

// One attention block's middle for a few new tokens per row, in one call: RoPE on the
// queries and keys of mixed [B, T, (H + 2 KV) * D] (the q|k|v product), the new keys and
// values written to slots [B, T] of the cache [B, KV, capacity, D], then decode_attention
// over its first `span` slots. cos, sin [B, T, D]. bf16 or fp32 throughout.
at::Tensor rope_attend(at::Tensor mixed, at::Tensor cos, at::Tensor sin, at::Tensor keys,
                       at::Tensor values, at::Tensor slots, at::Tensor visible, int64_t heads,
                       double scale, c10::optional<at::Tensor> prefix_keys,
                       c10::optional<at::Tensor> prefix_values,
                       c10::optional<at::Tensor> prefix_lens) {
  const int64_t B = mixed.size(0), T_ = mixed.size(1), KV = keys.size(1), D = keys.size(3);
  TORCH_CHECK(mixed.is_contiguous() && mixed.size(2) == (heads + 2 * KV) * D,
              "mixed: [B, T, (H + 2 KV) D]");
  TORCH_CHECK(keys.scalar_type() == mixed.scalar_type() && cos.scalar_type() == mixed.scalar_type(),
              "mixed, cos, sin and the cache must share a dtype");
  cos = cos.contiguous();
  sin = sin.contiguous();
  slots = slots.contiguous();
  auto q = at::empty({B, T_, heads, D}, mixed.options());
  if (mixed.scalar_type() == at::kFloat)
    rope_write<float>(mixed, cos, sin, keys, values, slots, q, heads);
  else
    rope_write<uint16_t>(mixed, cos, sin, keys, values, slots, q, heads);
  const int64_t span = visible.size(2);
  return decode_attention(q, keys.narrow(2, 0, span), values.narrow(2, 0, span), visible, scale,
                          prefix_keys, prefix_values, prefix_lens);
}

// The index of a row's first maximum, or of its first NaN where it has one (as torch.max
// gives them). Two passes over the row, the peak then its first position: torch's max
// with indices tracks both at once and took 2.3-2.8 ms for 77 rows of bf16 logits on the
// 2-core EPYC, against 0.4 for the peak alone.
template <typename T>
static int64_t first_peak(const T* x, int64_t V) {
  float best = -INFINITY;
  bool nan = false;
  int64_t d = 0;
#if defined(__AVX512F__)
  __m512 peak = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  for (; d + 16 <= V; d += 16) {
    const __m512 v = load16(x + d);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    peak = _mm512_max_ps(peak, v);
  }
  best = _mm512_reduce_max_ps(peak);
  nan = unordered != 0;
#endif
  for (; d < V; ++d) {
    const float v = widen1(x[d]);
    nan |= std::isnan(v);
    best = std::max(best, v);
  }
  d = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(best);
  for (; d + 16 <= V; d += 16) {
    const __m512 v = load16(x + d);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                              : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
    if (hit) return d + __builtin_ctz(hit);
  }
#endif
  for (; d < V; ++d) {
    const float v = widen1(x[d]);
    if (nan ? std::isnan(v) : v == best) return d;
  }
  return 0;
}

// Each row's first_peak over the last dimension of x (bf16 or fp32): x.max(-1).indices.
at::Tensor row_argmax(at::Tensor x) {
  x = x.contiguous();
  const int64_t V = x.size(-1), N = x.numel() / V;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  auto out = at::empty(shape, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const bool fp32 = x.scalar_type() == at::kFloat;
  TORCH_CHECK(fp32 || x.scalar_type() == at::kBFloat16, "bf16 or fp32, got ", x.scalar_type());
  const float* fp = fp32 ? x.data_ptr<float>() : nullptr;
  const uint16_t* bp = fp32 ? nullptr : reinterpret_cast<const uint16_t*>(x.data_ptr());
  at::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      op[i] = fp32 ? first_peak(fp + i * V, V) : first_peak(bp + i * V, V);
  });
  return out;
}

#if defined(__AVX512BF16__)
// The MLP's middle in bf16: gate_up [N, 2I] (gate | up, one product) -> [N, I] =
// bf16(bf16(silu(gate)) * up), rounding as F.silu then `*` do in bf16, in one pass where
// torch takes three (the chunk's copy, silu, the product). silu(x) = x / (1 + exp(-x)) in
// fp32 as torch computes it, with exp16's polynomial for torch's: within an fp32 ulp or
// two, so a bf16 result can differ from torch's by one bf16 ulp where the fp32 value sits
// on a rounding boundary.
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "bf16 only");
  gate_up = gate_up.contiguous();
  const int64_t I = gate_up.size(-1) / 2, N = gate_up.numel() / (2 * I);
  TORCH_CHECK(I % 16 == 0, "the intermediate size must be a multiple of 16");
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = I;
  auto out = at::empty(shape, gate_up.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(gate_up.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(out.data_ptr());
  const __m512 one = _mm512_set1_ps(1.f);
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint16_t* gate = xp + n * 2 * I;
      const uint16_t* up = gate + I;
      uint16_t* y = yp + n * I;
      for (int64_t i = 0; i < I; i += 16) {
        const __m512 g = widen16(gate + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
        // bf16(silu), widened back: the product sees what torch's would
        const __m512 rounded = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(silu)), 16));
        store16(y + i, _mm512_mul_ps(rounded, widen16(up + i)));
      }
    }
  });
  return out;
}
#else
// Without AVX512-BF16: torch's own ops, rounding as before.
at::Tensor silu_mul(at::Tensor gate_up) {
  const auto halves = gate_up.chunk(2, -1);
  return at::silu(halves[0]).mul(halves[1]);
}
#endif

// hidden . weight_j in fp32 (greedy_head.py: the exact score of a token the screen kept).
static inline float dot_fp32(const float* h, const float* w, int64_t H) {
  int64_t d = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= H; d += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(h + d), _mm512_loadu_ps(w + d), acc);
  total = _mm512_reduce_add_ps(acc);
#endif
  for (; d < H; ++d) total += h[d] * w[d];
  return total;
}

// fp32 greedy tokens from a bf16 lm_head (greedy_head.py says why and why it is exact):
// hidden [N, H] fp32; screen [N, V] bf16, the bf16 product of hidden and the weight;
// weight [V, H] fp32, dense; norms [V], each weight row's L2 norm. Token j's bf16 score
// is within bound_j = coeff |h| norms_j + rel |score_j| + 1e-30 of its fp32 score, so
// only the tokens whose score + bound reaches the highest score - bound could be the
// fp32 argmax: each row's first maximum of hidden . weight_j over those, or -1 where the
// row's scores hold a NaN or an infinity (the caller takes the full product there).
at::Tensor screened_argmax(at::Tensor hidden, at::Tensor screen, at::Tensor weight,
                           at::Tensor norms, double coeff, double rel) {
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                  norms.scalar_type() == at::kFloat && screen.scalar_type() == at::kBFloat16,
              "hidden, weight and norms fp32, screen bf16");
  hidden = hidden.contiguous();
  screen = screen.contiguous();
  TORCH_CHECK(weight.is_contiguous() && norms.is_contiguous(), "weight and norms: dense");
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  TORCH_CHECK(screen.size(0) == N && screen.size(1) == V && weight.size(1) == H &&
                  norms.size(0) == V, "shapes: hidden [N, H], screen [N, V], weight [V, H]");
  auto out = at::empty({N}, hidden.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const float* hp = hidden.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* np = norms.data_ptr<float>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(screen.data_ptr());
  const float c = static_cast<float>(coeff), r = static_cast<float>(rel), tiny = 1e-30f;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* h = hp + i * H;
      const float scale = c * std::sqrt(dot_fp32(h, h, H));
      const uint16_t* s = sp + i * V;
      // token j's bound (greedy_head.py), for one score and for 16 from j
      const auto bound1 = [&](float x, int64_t j) {
        return scale * np[j] + r * std::fabs(x) + tiny;
      };
      float floor = -INFINITY, poison = 0.f;  // poison: NaN once a score is NaN or inf
      int64_t j = 0;
#if defined(__AVX512F__)
      const __m512 cs = _mm512_set1_ps(scale), rs = _mm512_set1_ps(r), ts = _mm512_set1_ps(tiny);
      const auto bound16 = [&](__m512 x, int64_t j) {
        return _mm512_fmadd_ps(cs, _mm512_loadu_ps(np + j),
                               _mm512_fmadd_ps(rs, _mm512_abs_ps(x), ts));
      };
      __m512 floors = _mm512_set1_ps(-INFINITY), poisons = _mm512_setzero_ps();
      for (; j + 16 <= V; j += 16) {
        const __m512 x = widen16(s + j);
        floors = _mm512_max_ps(floors, _mm512_sub_ps(x, bound16(x, j)));
        poisons = _mm512_add_ps(poisons, _mm512_mul_ps(x, _mm512_setzero_ps()));
      }
      floor = _mm512_reduce_max_ps(floors);
      poison = _mm512_reduce_add_ps(poisons);
#endif
      for (; j < V; ++j) {
        const float x = widen1(s[j]);
        floor = std::max(floor, x - bound1(x, j));
        poison += x * 0.f;
      }
      int64_t best = -1;
      float top = -INFINITY;
      const auto consider = [&](int64_t k) {  // ascending k: the first maximum wins
        const float exact = dot_fp32(h, wp + k * H, H);
        if (best < 0 || exact > top) best = k, top = exact;
      };
      if (!std::isnan(poison) && !std::isnan(floor)) {
        j = 0;
#if defined(__AVX512F__)
        const __m512 fs = _mm512_set1_ps(floor);
        for (; j + 16 <= V; j += 16) {
          const __m512 x = widen16(s + j);
          const __m512 reach = _mm512_add_ps(x, bound16(x, j));
          for (__mmask16 kept = _mm512_cmp_ps_mask(reach, fs, _CMP_GE_OQ); kept;
               kept &= kept - 1)
            consider(j + __builtin_ctz(kept));
        }
#endif
        for (; j < V; ++j) {
          const float x = widen1(s[j]);
          if (x + bound1(x, j) >= floor) consider(j);
        }
        if (std::isnan(top)) best = -1;
      }
      op[i] = best;
    }
  });
  return out;
}

// Products of a few fp32 rows (one token, a small tree) with a weight packed by
// cpu_kernels.py's `pack_rows`: [NB, K, 16], each block 16 outputs' weights side by side,
// so that a block is one stream and its 16 outputs of a row are two FMA accumulators
// (no horizontal sums). Memory-bound: the weights stream once, each row's inputs are
// broadcast from L1. R rows go through each block while it is in cache, six at a time.
#if defined(__AVX2__) && defined(__FMA__)
// Rows r0..r0+R of x [., K] times one block: each k's 16 weights times R broadcasts. R <= 2
// keeps k and k + 1 apart in two accumulators each (one FMA chain per output would wait
// on its own latency), summed at the end; more rows give the core chains enough.
template <int R, bool PAIRED>
static inline void rows_block(const float* p, const float* x, int64_t K, float* y,
                              int64_t ys) {
  __m256 a[R][2], b[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = b[r][0] = b[r][1] = _mm256_setzero_ps();
  int64_t k = 0;
  if constexpr (PAIRED) {
    for (; k + 2 <= K; k += 2, p += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(p + 512), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + 528), _MM_HINT_T0);
      const __m256 w0 = _mm256_loadu_ps(p), w1 = _mm256_loadu_ps(p + 8);
      const __m256 v0 = _mm256_loadu_ps(p + 16), v1 = _mm256_loadu_ps(p + 24);
      for (int r = 0; r < R; ++r) {
        const __m256 x0 = _mm256_broadcast_ss(x + r * K + k);
        const __m256 x1 = _mm256_broadcast_ss(x + r * K + k + 1);
        a[r][0] = _mm256_fmadd_ps(w0, x0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(w1, x0, a[r][1]);
        b[r][0] = _mm256_fmadd_ps(v0, x1, b[r][0]);
        b[r][1] = _mm256_fmadd_ps(v1, x1, b[r][1]);
      }
    }
  }
  for (; k < K; ++k, p += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(p + 512), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(p), w1 = _mm256_loadu_ps(p + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 x0 = _mm256_broadcast_ss(x + r * K + k);
      a[r][0] = _mm256_fmadd_ps(w0, x0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(w1, x0, a[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ys, _mm256_add_ps(a[r][0], b[r][0]));
    _mm256_storeu_ps(y + r * ys + 8, _mm256_add_ps(a[r][1], b[r][1]));
  }
}

// All R rows of x times one block, into y [R, 16] (row stride ys).
static void rows_times_block(const float* p, const float* x, int64_t R, int64_t K, float* y,
                             int64_t ys) {
  int64_t r = 0;
  for (; r + 6 <= R; r += 6) rows_block<6, false>(p, x + r * K, K, y + r * ys, ys);
  const float* xr = x + r * K;
  float* yr = y + r * ys;
  switch (R - r) {
    case 1: rows_block<1, true>(p, xr, K, yr, ys); break;
    case 2: rows_block<2, true>(p, xr, K, yr, ys); break;
    case 3: rows_block<3, false>(p, xr, K, yr, ys); break;
    case 4: rows_block<4, false>(p, xr, K, yr, ys); break;
    case 5: rows_block<5, false>(p, xr, K, yr, ys); break;
    default: break;
  }
}
#endif

// x [R, K] fp32 times the packed weight [NB, K, 16] of an [N, K] one (+ bias [N]): [R, N].
at::Tensor rows_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias,
                       int64_t N) {
#if defined(__AVX2__) && defined(__FMA__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "rows_linear: fp32 x [R, K] and a packed fp32 weight");
  x = x.contiguous();
  const int64_t R = x.size(0), K = x.size(1), NB = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == 16 &&
                  NB * 16 >= N && (NB - 1) * 16 < N,
              "rows_linear: the packed weight does not match x");
  auto y = at::empty({R, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, NB, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> part;  // a last block of fewer than 16 outputs is computed here
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * 16, width = std::min<int64_t>(16, N - n0);
      float* out = yp + n0;
      int64_t ys = N;
      if (width < 16) {
        part.assign(R * 16, 0.f);
        out = part.data(), ys = 16;
      }
      rows_times_block(pp + nb * K * 16, xp, R, K, out, ys);
      for (int64_t r = 0; r < R; ++r) {
        float* row = yp + r * N + n0;
        if (width < 16) std::memcpy(row, out + r * 16, width * sizeof(float));
        if (bp != nullptr)
          for (int64_t j = 0; j < width; ++j) row[j] += bp[n0 + j];
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "rows_linear needs AVX2 and FMA");
  return x;
#endif
}
