// The native narrow-weight CPU kernel of torchsurgery.compact.narrow_matvec.
//
// y = x @ W.T + b (or x @ W + b for a weight stored [in, out]) for x of 1 to 8 fp32 rows and
// W stored in bf16, fp16 or fp8 (e4m3fn, e5m2): each weight element is widened in registers
// and accumulated in fp32, so a step reads the narrow bytes once. A plain shared library with
// one C entry point, ts_narrow_matvec, called through ctypes (see narrow_matvec.py): it
// includes no torch header, so it builds in a second or two rather than the quarter of a
// minute torch's headers take, and does not depend on torch's version.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#ifndef TS_KIND  // one library per weight dtype: each builds in a fraction of the time of all four
#error "build with -DTS_KIND=0 (bf16), 1 (fp16), 2 (e4m3fn), 3 (e5m2) or 4 (int8)"
#endif

namespace {

// f(begin, end) over [0, n) split into at most `threads` ranges of at least `grain` items
// (OpenMP: torch's own runtime where torch is loaded first, the library of the same name)
template <class F>
void parallel_for(int64_t n, int64_t grain, int threads, const F& f) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, (n + grain - 1) / std::max<int64_t>(grain, 1)));
#if defined(_OPENMP)
  if (parts > 1) {
#pragma omp parallel num_threads(int(parts))
    {
      const int64_t per = (n + parts - 1) / parts, begin = omp_get_thread_num() * per;
      if (begin < n) f(begin, std::min(n, begin + per));
    }
    return;
  }
#endif
  f(0, n);
}

// fp32 lanes of one vector: a register's width. The accumulators of a row's dot products are
// vectors of this width, kChains of them in all: as many as the register file holds with room
// for the operands (AVX-512: 32 registers of 16 lanes; AVX and AVX2: 16 of 8, where vectors of
// 16 lanes, each two registers, spilled the accumulators to memory on every step, measured at a
// quarter of the memory's speed for int8 and a twentieth for e4m3fn; elsewhere, as SSE2 alone or
// NEON, the portable code of 16 lanes: measured on the x86-64 baseline, 4 lanes and 8 chains
// read bf16 at three quarters and int8 at half the speed of 16 and 16)
#if defined(__AVX512F__) || !defined(__AVX__)
constexpr int kLanes = 16;
constexpr int kChains = 16;
#else
constexpr int kLanes = 8;
constexpr int kChains = 8;
#endif
typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef uint32_t vu32 __attribute__((vector_size(kLanes * 4)));
typedef uint16_t vu16 __attribute__((vector_size(kLanes * 2)));
typedef uint8_t vu8 __attribute__((vector_size(kLanes)));
typedef int16_t vi16 __attribute__((vector_size(kLanes * 2)));

enum Kind { kBF16, kF16, kE4M3, kE5M2, kI8 };

template <int K>
constexpr int kBytes = K == kBF16 || K == kF16 ? 2 : 1;  // one weight element

// how far ahead of the weight row being summed its bytes are asked for (0: none): the
// caller's choice, measured on this machine (see narrow_matvec.py); each cache line twice:
// into the second-level cache 4x as far ahead, then into the first (measured on an Intel Xeon,
// 2 threads: 20 GB/s with the first alone, 27 GB/s with both, where a plain read gets 21)
inline void prefetch_ahead(const void* p, int64_t byte, int64_t span, int64_t distance) {
  if (distance <= 0) return;
  const char* near = static_cast<const char*>(p) + byte + distance;
  const char* far = near + 3 * distance;
  for (int64_t b = 0; b < span; b += 64) {
    __builtin_prefetch(far + b, 0, 2);
    __builtin_prefetch(near + b, 0, 3);
  }
}

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// scalar widening (tails and biases), exact for every value, subnormals included
inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  if (exp == 0) {
    float v = float(man) * (1.0f / 16777216.0f);  // man * 2^-24
    return (h & 0x8000) ? -v : v;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (man << 13));
  return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
}

// e4m3fn as an fp16 bit pattern 2^8 too small: the exponent bias differs by 8
inline uint16_t e4m3_to_half_bits(uint8_t b) {
  return uint16_t((uint16_t(b & 0x80) << 8) | (uint16_t(b & 0x7f) << 7));
}

template <int K>
inline float widen1(const void* p, int64_t i) {
  if constexpr (K == kBF16) {
    return bits_to_float(uint32_t(static_cast<const uint16_t*>(p)[i]) << 16);
  } else if constexpr (K == kF16) {
    return half_to_float(static_cast<const uint16_t*>(p)[i]);
  } else if constexpr (K == kI8) {
    return float(static_cast<const int8_t*>(p)[i]);
  } else if constexpr (K == kE4M3) {
    uint8_t b = static_cast<const uint8_t*>(p)[i];
    if ((b & 0x7f) == 0x7f) return bits_to_float(0x7fc00000u);  // e4m3fn's only NaN
    return half_to_float(e4m3_to_half_bits(b)) * 256.0f;
  } else {
    return half_to_float(uint16_t(static_cast<const uint8_t*>(p)[i]) << 8);  // e5m2: fp16's top byte
  }
}

inline vf halves_to_floats(vu16 h) {
#if defined(__AVX512F__)
  __m256i v;
  std::memcpy(&v, &h, 32);
  return (vf)_mm512_cvtph_ps(v);
#elif defined(__F16C__)  // with AVX: 8 lanes
  static_assert(kLanes == 8, "F16C widens 8 halves at a time");
  __m128i v;
  std::memcpy(&v, &h, 16);
  return (vf)_mm256_cvtph_ps(v);
#else
  vf out;
  for (int j = 0; j < kLanes; ++j) out[j] = half_to_float(h[j]);
  return out;
#endif
}

// kLanes int8 values to fp32, and kLanes bytes to 16 bits each (with intrinsics where there are
// some: GCC 12 widens a vector of bytes lane by lane)
inline vf int8_to_floats(const int8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vf out;
  for (int j = 0; j < kLanes; ++j) out[j] = float(p[j]);
  return out;
#endif
}

inline vu16 bytes_to_u16(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vu16)_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return (vu16)_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  vu8 b;
  std::memcpy(&b, p, kLanes);
  return __builtin_convertvector(b, vu16);
#endif
}

// kLanes weights from element i on, widened to fp32
template <int K>
inline vf widen(const void* p, int64_t i) {
  if constexpr (K == kBF16) {
#if defined(__AVX512F__)
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#elif defined(__AVX2__)
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else
    vu16 h;
    std::memcpy(&h, static_cast<const uint16_t*>(p) + i, sizeof(h));
    return (vf)(__builtin_convertvector(h, vu32) << 16);
#endif
  } else if constexpr (K == kF16) {
    vu16 h;
    std::memcpy(&h, static_cast<const uint16_t*>(p) + i, sizeof(h));
    return halves_to_floats(h);
  } else if constexpr (K == kI8) {
    return int8_to_floats(static_cast<const int8_t*>(p) + i);
  } else {
    vu16 w = bytes_to_u16(static_cast<const uint8_t*>(p) + i);
    if constexpr (K == kE5M2) {
      return halves_to_floats(w << 8);
    } else {
      vf f = halves_to_floats(((w & 0x80) << 8) | ((w & 0x7f) << 7)) * 256.0f;
      // e4m3fn's NaN (0x7f, either sign) reads as +-480 here, a value no other pattern has
      vu32 nan = (vu32)((f == 480.0f) | (f == -480.0f));  // all ones where NaN
      return (vf)(((vu32)f & ~nan) | (nan & 0x7fc00000u));
    }
  }
}

inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX2__)
  __m128 a = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
#else
  float s = 0.0f;
  for (int j = 0; j < kLanes; ++j) s += v[j];
  return s;
#endif
}

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// e4m3fn for a dot product: the fp16 pattern (sign kept, the exponent's top bit clear) without
// the 2^8 scale, which the caller applies to the sum (exact: a power of two), and without the
// NaN blend: the caller looks for e4m3fn's NaN (0x7f, either sign) in the row first, whose
// pattern would otherwise read as 1.875
inline vf widen_e4m3_unscaled(const void* p, int64_t i) {
  vu16 w = bytes_to_u16(static_cast<const uint8_t*>(p) + i);
  return halves_to_floats((vu16)((vi16)(w << 8) >> 1) & 0xBFFF);
}

template <int K>
inline vf widen_for_sum(const void* p, int64_t i) {
  if constexpr (K == kE4M3) {
    return widen_e4m3_unscaled(p, i);
  } else {
    return widen<K>(p, i);
  }
}

// 2 x kLanes weights from element i on, as widen_for_sum gives them: with AVX2 alone, fp8's 16
// bytes go to 16 bits in one instruction for both vectors (measured: a fifth fewer instructions
// a weight, which is what the 8-lane fp8 widening is bound by)
template <int K>
inline void widen_two_for_sum(const void* p, int64_t i, vf& a, vf& b) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (K == kE4M3 || K == kE5M2) {
    __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(p) + i)));
    h = _mm256_slli_epi16(h, 8);
    if constexpr (K == kE4M3) h = _mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16(short(0xBFFF)));
    a = (vf)_mm256_cvtph_ps(_mm256_castsi256_si128(h));
    b = (vf)_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    return;
  }
#endif
  a = widen_for_sum<K>(p, i);
  b = widen_for_sum<K>(p, i + kLanes);
}

typedef uint8_t vu8x64 __attribute__((vector_size(64)));

// whether bytes [begin, begin + n) hold e4m3fn's NaN: 64 at a time (the row is then in the
// cache for the dot products that follow, so this costs no memory traffic)
inline bool has_e4m3_nan(const void* p, int64_t begin, int64_t n) {
  const uint8_t* b = static_cast<const uint8_t*>(p) + begin;
  uint64_t any = 0;
  int64_t i = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)  // GCC 12 compares a vector of 64 bytes one byte at a time here
  const __m256i magnitude = _mm256_set1_epi8(0x7f);
  __m256i found = _mm256_setzero_si256();
  for (; i + 32 <= n; i += 32) {
    const __m256i v = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i)), magnitude);
    found = _mm256_or_si256(found, _mm256_cmpeq_epi8(v, magnitude));
  }
  any = uint64_t(_mm256_movemask_epi8(found) != 0);
#elif defined(__SSE2__) && !defined(__AVX512F__)  // the x86-64 baseline: the same, 16 bytes at a time
  const __m128i magnitude = _mm_set1_epi8(0x7f);
  __m128i found = _mm_setzero_si128();
  for (; i + 16 <= n; i += 16) {
    const __m128i v = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)), magnitude);
    found = _mm_or_si128(found, _mm_cmpeq_epi8(v, magnitude));
  }
  any = uint64_t(_mm_movemask_epi8(found) != 0);
#else
  vu8x64 found{};
  for (; i + 64 <= n; i += 64) {
    vu8x64 v;
    std::memcpy(&v, b + i, 64);
    found |= (vu8x64)((v & 0x7f) == 0x7f);
  }
  uint64_t words[8];
  std::memcpy(words, &found, 64);
  for (int j = 0; j < 8; ++j) any |= words[j];
#endif
  for (; i < n; ++i) any |= (b[i] & 0x7f) == 0x7f;
  return any != 0;
}

// R dot products: weight row o against x's rows, C accumulator chains per row, kChains in all
// (measured with AVX-512: 8 chains leave the FMA units waiting half the time)
template <int K, int R>
inline void dots(const float* x, const void* w, int64_t in, int64_t o, float* sums, int64_t ahead) {
  constexpr int C = R >= kChains ? 1 : kChains / R;
  constexpr float kScale = K == kE4M3 ? 256.0f : 1.0f;  // what widen_for_sum left out
  const int64_t base = o * in;
  vf acc[C][R];
  if constexpr (K == kE4M3) {
    if (has_e4m3_nan(w, base, in)) {  // a NaN weight makes every sum of the row NaN
      for (int r = 0; r < R; ++r) sums[r] = bits_to_float(0x7fc00000u);
      return;
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = vf{};
  int64_t k = 0;
  for (; k + C * kLanes <= in; k += C * kLanes) {
    prefetch_ahead(w, (base + k) * kBytes<K>, C * kLanes * kBytes<K>, ahead);
    if constexpr (C % 2 == 0) {
      for (int c = 0; c < C; c += 2) {
        vf wa, wb;
        widen_two_for_sum<K>(w, base + k + c * kLanes, wa, wb);
        for (int r = 0; r < R; ++r) {
          acc[c][r] += wa * load(x + r * in + k + c * kLanes);
          acc[c + 1][r] += wb * load(x + r * in + k + (c + 1) * kLanes);
        }
      }
    } else {
      for (int c = 0; c < C; ++c) {
        vf wv = widen_for_sum<K>(w, base + k + c * kLanes);
        for (int r = 0; r < R; ++r) acc[c][r] += wv * load(x + r * in + k + c * kLanes);
      }
    }
  }
  for (; k + kLanes <= in; k += kLanes) {
    vf wv = widen_for_sum<K>(w, base + k);
    for (int r = 0; r < R; ++r) acc[0][r] += wv * load(x + r * in + k);
  }
  for (int r = 0; r < R; ++r) {
    vf a = acc[0][r];
    for (int c = 1; c < C; ++c) a += acc[c][r];
    float s = hsum(a) * kScale;
    for (int64_t j = k; j < in; ++j) s += widen1<K>(w, base + j) * x[r * in + j];
    sums[r] = s;
  }
}

#if defined(__AVX512VBMI__)  // byte permutes (Ice Lake, Zen 4 and later); elsewhere dots<K, R>
// fp8 64 weights at a time. Each byte becomes an fp16 pattern of two bytes, interleaved by
// the byte unpacks: for e5m2 the byte itself over a zero byte (e5m2 is fp16's top byte); for
// e4m3fn two table lookups on the byte's magnitude (vpermi2b, 128 entries each) give the high
// and low byte of its exact fp16 value, NaN included, and the sign is put back. This takes a
// fraction of the vector operations of widening 16 bytes at a time (measured: the 16-wide
// widening kept the e4m3fn kernel at half the memory's speed). The unpacks interleave within
// each 16-byte lane, so the fp32 vectors hold the 8-element chunks 0,2 | 4,6 | 1,3 | 5,7 of
// the 64: x is put in that order once per call (fp8_block_order).
constexpr int kBlock8 = 64;

struct E4M3Tables {
  __m512i hi0, hi1, lo0, lo1;  // the high and low byte of fp16(e4m3fn(m)) for m in [0, 64) and [64, 128)
};

inline E4M3Tables e4m3_tables() {
  alignas(64) uint8_t hi[128], lo[128];
  for (int m = 0; m < 128; ++m) {
    uint16_t bits;
    if (m == 0x7f) {
      bits = 0x7e00;  // NaN
    } else {  // the 2^-8-scaled pattern, times 2^8 in the exponent: exact, fp16 holds every e4m3fn value
      float v = half_to_float(e4m3_to_half_bits(uint8_t(m))) * 256.0f;
      bits = _cvtss_sh(v, 0);
    }
    hi[m] = uint8_t(bits >> 8);
    lo[m] = uint8_t(bits & 0xff);
  }
  return {_mm512_load_si512(hi), _mm512_load_si512(hi + 64), _mm512_load_si512(lo), _mm512_load_si512(lo + 64)};
}

// 64 fp8 weights to four fp32 vectors (in the unpacks' order, see above); e4m3fn exact
template <int K>
inline void widen64(const uint8_t* p, const E4M3Tables& t, __m512& f0, __m512& f1, __m512& f2, __m512& f3) {
  const __m512i b = _mm512_loadu_si512(p);
  __m512i hi, lo;
  if constexpr (K == kE5M2) {
    hi = b;
    lo = _mm512_setzero_si512();
  } else {
    // the tables read the index's low 7 bits: the magnitude; the sign is or-ed back
    hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, b, t.hi1), b, _mm512_set1_epi8(char(0x80)),
                                   0xf8);  // A | (B & C)
    lo = _mm512_permutex2var_epi8(t.lo0, b, t.lo1);
  }
  const __m512i h0 = _mm512_unpacklo_epi8(lo, hi), h1 = _mm512_unpackhi_epi8(lo, hi);
  f0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h0));
  f1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h0, 1));
  f2 = _mm512_cvtph_ps(_mm512_castsi512_si256(h1));
  f3 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h1, 1));
}

// x's rows with each whole block of 64 columns in widen64's order; the tail as it is
void fp8_block_order(const float* x, float* xp, int64_t rows, int64_t in) {
  static constexpr int kChunks[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  const int64_t blocks = in / kBlock8;
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + r * in;
    float* dst = xp + r * in;
    for (int64_t blk = 0; blk < blocks; ++blk)
      for (int c = 0; c < 8; ++c) std::memcpy(dst + blk * kBlock8 + c * 8, src + blk * kBlock8 + kChunks[c] * 8, 32);
    std::memcpy(dst + blocks * kBlock8, src + blocks * kBlock8, (in - blocks * kBlock8) * sizeof(float));
  }
}

// dots<K, R> for fp8 with x in fp8_block_order: 4 accumulator chains per block, 2 blocks per
// step for one row (8 chains)
template <int K, int R>
inline void dots_fp8(const float* xp, const void* w, const E4M3Tables& t, int64_t in, int64_t o, float* sums,
                     int64_t ahead) {
  constexpr int U = R == 1 ? 2 : 1;
  const int64_t base = o * in;
  const uint8_t* row = static_cast<const uint8_t*>(w) + base;
  __m512 acc[U][4][R];
  for (int u = 0; u < U; ++u)
    for (int c = 0; c < 4; ++c)
      for (int r = 0; r < R; ++r) acc[u][c][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + U * kBlock8 <= in; k += U * kBlock8)
    for (int u = 0; u < U; ++u) {
      __m512 f[4];
      prefetch_ahead(row, k + u * kBlock8, kBlock8, ahead);
      widen64<K>(row + k + u * kBlock8, t, f[0], f[1], f[2], f[3]);
      for (int c = 0; c < 4; ++c)
        for (int r = 0; r < R; ++r)
          acc[u][c][r] = _mm512_fmadd_ps(f[c], _mm512_loadu_ps(xp + r * in + k + u * kBlock8 + c * kLanes), acc[u][c][r]);
    }
  for (; k + kBlock8 <= in; k += kBlock8) {
    __m512 f[4];
    widen64<K>(row + k, t, f[0], f[1], f[2], f[3]);
    for (int c = 0; c < 4; ++c)
      for (int r = 0; r < R; ++r)
        acc[0][c][r] = _mm512_fmadd_ps(f[c], _mm512_loadu_ps(xp + r * in + k + c * kLanes), acc[0][c][r]);
  }
  for (int r = 0; r < R; ++r) {
    __m512 a = acc[0][0][r];
    for (int u = 0; u < U; ++u)
      for (int c = 0; c < 4; ++c)
        if (u || c) a = _mm512_add_ps(a, acc[u][c][r]);
    float s = _mm512_reduce_add_ps(a);
    int64_t j = k;
    for (; j + kLanes <= in; j += kLanes)  // the tail, in x's own order, through widen (exact, NaN kept)
      s += hsum(widen<K>(w, base + j) * load(xp + r * in + j));
    for (; j < in; ++j) s += widen1<K>(w, base + j) * xp[r * in + j];
    sums[r] = s;
  }
}
#endif

// One call's operands: y[rows, out] = (x[rows, in] @ W.T) * scale + bias (or x @ W, transposed)
struct Call {
  const float* x;
  const void* w;
  const float* bias;   // none, or `out` fp32 values
  const float* scale;  // none, or one per output (scale_step 1) or one for all (scale_step 0)
  int64_t scale_step;
  float* y;
  int64_t in, out;
  int threads;
  bool generic;   // the portable vector path only
  int64_t ahead;  // bytes of the weight row asked for ahead of the sums (0: none)

  // output o of row r from its sum: the scale on the sum (exactly as (x @ q.T) * scale), then the bias
  float finish(float sum, int64_t o) const {
    if (scale) sum *= scale[o * scale_step];
    return bias ? sum + bias[o] : sum;
  }
};

// weight [out, in]: one output after the other, so that the weight is read front to back,
// the bytes ahead asked for while the row is summed (measured on an Intel Xeon with AVX-512:
// without it one stream per thread reads at two thirds of the memory's speed)
// (generic: dots<K, R> even where the fp8 blocks of 64 would run, so that tests reach it on every CPU)
template <int K, int R>
void rows_kernel(const Call& c) {
  const int64_t in = c.in, out = c.out;
  int64_t grain = std::max<int64_t>(16, (int64_t(1) << 16) / std::max<int64_t>(in, 1));
#if defined(__AVX512VBMI__)
  if constexpr ((K == kE4M3 || K == kE5M2) && R <= 4) {
    if (in >= kBlock8 && !c.generic) {
      std::unique_ptr<float[]> xp(new float[R * in]);
      fp8_block_order(c.x, xp.get(), R, in);
      static const E4M3Tables tables = e4m3_tables();  // once per process
      parallel_for(out, grain, c.threads, [&](int64_t begin, int64_t end) {
        float sums[R];
        for (int64_t o = begin; o < end; ++o) {
          dots_fp8<K, R>(xp.get(), c.w, tables, in, o, sums, c.ahead);
          for (int r = 0; r < R; ++r) c.y[r * out + o] = c.finish(sums[r], o);
        }
      });
      return;
    }
  }
#endif
  parallel_for(out, grain, c.threads, [&](int64_t begin, int64_t end) {
    float sums[R];
    for (int64_t o = begin; o < end; ++o) {
      dots<K, R>(c.x, c.w, in, o, sums, c.ahead);
      for (int r = 0; r < R; ++r) c.y[r * out + o] = c.finish(sums[r], o);
    }
  });
}

// weight [in, out]: y[r, cols] += x[r, i] * W[i, cols] over IB weight rows at a time (the
// partial sums are loaded and stored once per IB rows), the partial sums of a block of
// columns (32 KiB) kept in the first-level cache
template <int K, int R>
void cols_kernel(const Call& c) {
  constexpr int IB = R <= 2 ? 1 : R <= 4 ? 2 : 4;
  constexpr int64_t kBlock = 8192 / R / kLanes * kLanes;
  const float* x = c.x;
  const void* w = c.w;
  const int64_t in = c.in, out = c.out;
  int64_t vectors = (out + kLanes - 1) / kLanes;
  int64_t grain = std::max<int64_t>(4, (int64_t(1) << 16) / std::max<int64_t>(in, 1) / kLanes);
  parallel_for(vectors, grain, c.threads, [&](int64_t vbegin, int64_t vend) {
    std::unique_ptr<float[]> part(new float[R * kBlock]);
    int64_t stop = std::min(vend * kLanes, out);
    for (int64_t c0 = vbegin * kLanes; c0 < stop; c0 += kBlock) {
      int64_t width = std::min(kBlock, stop - c0);
      int64_t full = width / kLanes * kLanes;
      std::fill(part.get(), part.get() + R * kBlock, 0.0f);
      int64_t i = 0;
      for (; i + IB <= in; i += IB) {
        float xs[R][IB];
        for (int r = 0; r < R; ++r)
          for (int t = 0; t < IB; ++t) xs[r][t] = x[r * in + i + t];
        const int64_t row = i * out + c0;
        for (int64_t j = 0; j < full; j += kLanes) {
          vf wv[IB];
          for (int t = 0; t < IB; ++t) wv[t] = widen<K>(w, row + t * out + j);
          for (int r = 0; r < R; ++r) {
            float* p = &part[r * kBlock + j];
            vf a = load(p);
            for (int t = 0; t < IB; ++t) a += xs[r][t] * wv[t];
            store(p, a);
          }
        }
        for (int64_t j = full; j < width; ++j)
          for (int t = 0; t < IB; ++t) {
            float wt = widen1<K>(w, row + t * out + j);
            for (int r = 0; r < R; ++r) part[r * kBlock + j] += xs[r][t] * wt;
          }
      }
      for (; i < in; ++i)
        for (int64_t j = 0; j < width; ++j) {
          float wt = widen1<K>(w, i * out + c0 + j);
          for (int r = 0; r < R; ++r) part[r * kBlock + j] += x[r * in + i] * wt;
        }
      for (int r = 0; r < R; ++r)
        for (int64_t j = 0; j < width; ++j) c.y[r * out + c0 + j] = c.finish(part[r * kBlock + j], c0 + j);
    }
  });
}

template <int K>
int run(bool transposed, int64_t rows, Call c, const void* bias, bool narrow_bias) {
  c.bias = static_cast<const float*>(bias);
  std::unique_ptr<float[]> wide;
  if (bias != nullptr && narrow_bias) {  // stored as narrow as the weight
    wide.reset(new float[c.out]);
    for (int64_t j = 0; j < c.out; ++j) wide[j] = widen1<K>(bias, j);
    c.bias = wide.get();
  }
#define TS_ROWS(R)             \
  case R:                      \
    if (transposed)            \
      cols_kernel<K, R>(c);    \
    else                       \
      rows_kernel<K, R>(c);    \
    return 0;
  switch (rows) {
    TS_ROWS(1) TS_ROWS(2) TS_ROWS(3) TS_ROWS(4) TS_ROWS(5) TS_ROWS(6) TS_ROWS(7) TS_ROWS(8)
    default:
      return 2;
  }
#undef TS_ROWS
}

}  // namespace

// y[rows, out] = (x[rows, in] @ W.T) * scale + bias (W [out, in]), or (x @ W) * scale + bias
// (W [in, out], transposed): x and y contiguous fp32, W contiguous in `kind` (0 bf16, 1 fp16,
// 2 e4m3fn, 3 e5m2, 4 int8), bias none, `out` fp32 values or (narrow_bias) `out` values in W's
// dtype, scale none, `out` fp32 values (scale_step 1) or one (scale_step 0). Returns 0, or 1
// for an unknown kind, 2 for rows outside 1..8, 3 for an empty shape; the caller checks the
// rest. generic: the portable vector path only (no fp8 blocks of 64 where AVX-512 VBMI has
// them). ahead: bytes of a weight row to ask for ahead of the sums (0: none).
extern "C" int ts_narrow_matvec(const float* x, const void* w, const void* bias, int narrow_bias, const float* scale,
                                int64_t scale_step, float* y, int64_t rows, int64_t in, int64_t out, int kind,
                                int transposed, int threads, int generic, int64_t ahead) {
  if (in <= 0 || out <= 0) return 3;
  if (kind != TS_KIND) return 1;
  Call c{x, w, nullptr, scale, scale_step, y, in, out, threads, generic != 0, ahead};
  return run<TS_KIND>(transposed, rows, c, bias, narrow_bias != 0);
}
