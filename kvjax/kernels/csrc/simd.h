// Float vectors for kvjax's CPU kernels: 16 lanes with AVX-512, else 8 (AVX2 and others), as
// GCC vector extensions, with loads and stores of the first n < kLanes lanes, and loads of int8
// data as floats.

#ifndef KVJAX_CSRC_SIMD_H_
#define KVJAX_CSRC_SIMD_H_

#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvjax {

#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec Load(const float* p) { Vec v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

// The first n < kLanes floats at p, zeros after; never touches memory past p + n.
inline Vec LoadPart(const float* p, int64_t n) {
#if defined(__AVX512F__)
  return (Vec)_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
#elif defined(__AVX2__)
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return (Vec)_mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lanes));
#else
  Vec v = {};
  std::memcpy(&v, p, n * sizeof(float));
  return v;
#endif
}

inline void StorePart(float* p, Vec v, int64_t n) {
#if defined(__AVX512F__)
  _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), (__m512)v);
#else
  float lanes[kLanes];
  Store(lanes, v);
  std::memcpy(p, lanes, n * sizeof(float));
#endif
}

// kLanes elements of float, int8, bfloat16, float16 or float8_e4m3fn data as floats (LoadAs), or the first n < kLanes of them,
// zeros after (LoadPartAs, never touching memory past p + n).
inline Vec LoadAs(const float* p) { return Load(p); }
inline Vec LoadPartAs(const float* p, int64_t n) { return LoadPart(p, n); }
// (GCC's __builtin_convertvector from int8 lanes runs one lane at a time: the widening is spelled out.)
inline Vec LoadAs(const int8_t* p) {
#if defined(__AVX512F__)
  return (Vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (Vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = p[i];
  return v;
#endif
}
// bfloat16 (its bits, as uint16_t) widened to float: the bits shifted into a float's upper half.
inline Vec LoadAs(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (Vec)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#elif defined(__AVX2__)
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (Vec)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
#else
  Vec v;
  for (int i = 0; i < kLanes; ++i) {
    const uint32_t wide = uint32_t{p[i]} << 16;
    std::memcpy(&v[i], &wide, sizeof(float));
  }
  return v;
#endif
}

// Cache element types stored as bits: distinct types, so that a loader is chosen by what the
// bits mean (kvjax.cache.codec's bfloat16, float16 and float8_e4m3fn).
struct BFloat16 { uint16_t bits; };
struct Float16 { uint16_t bits; };
struct Float8E4M3 { uint8_t bits; };

inline Vec LoadAs(const BFloat16* p) { return LoadAs(reinterpret_cast<const uint16_t*>(p)); }

// IEEE half to float, exactly (subnormals, infinities and NaN included): the portable path.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  float magnitude;
  if (exponent == 0) magnitude = mantissa * 0x1p-24f;
  else if (exponent == 31) magnitude = mantissa ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  else {
    const uint32_t bits = ((exponent + 112) << 23) | (mantissa << 13);
    std::memcpy(&magnitude, &bits, sizeof(float));
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, sizeof(float));
  bits |= sign;
  std::memcpy(&magnitude, &bits, sizeof(float));
  return magnitude;
}

inline Vec LoadAs(const Float16* p) {
#if defined(__AVX512F__)
  return (Vec)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__) && defined(__F16C__)
  return (Vec)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = HalfToFloat(p[i].bits);
  return v;
#endif
}

// float8_e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits, no infinity) as its value
// x 2^-8: with F16C, the byte's bits are moved into a half's (the sign to bit 15, exponent and
// mantissa under it, so the half holds the value x 2^-8, subnormals included) and widened by the
// hardware; a caller multiplies its per-vector scale by 256 (Storage<Float8E4M3>::kUnit). The
// NaN codes 0x7F and 0xFF, which kvjax's codec writes only beside a NaN scale, read as +-480 x 2^-8.
struct Fp8Table {  // the portable path: every code
  float value[256];
  Fp8Table() {
    for (int code = 0; code < 256; ++code) {
      const int exponent = (code >> 3) & 0xF, mantissa = code & 7;
      const float magnitude = exponent ? std::ldexp(1.0f + mantissa / 8.0f, exponent - 15) : std::ldexp(float(mantissa), -17);
      value[code] = code & 0x80 ? -magnitude : magnitude;
    }
  }
};
inline const Fp8Table kFp8;

inline Vec LoadAs(const Float8E4M3* p) {
  // A code sign-extended to 16 bits and shifted left by 7 has the sign in bit 15 and the code's
  // other bits in 13..7; bit 14 (a copy of the sign) is cleared.
#if defined(__AVX512F__)
  const __m256i words = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (Vec)_mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(words, 7), _mm256_set1_epi16(int16_t(0xBF80))));
#elif defined(__AVX2__) && defined(__F16C__)
  const __m128i words = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return (Vec)_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(words, 7), _mm_set1_epi16(int16_t(0xBF80))));
#else
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = kFp8.value[p[i].bits];
  return v;
#endif
}

// int4 codes (kvjax.cache.codec.Int4: element 2j in the low nibble of byte j, 2j + 1 in the high
// one) as floats. LoadNibbles: kLanes consecutive elements from kLanes / 2 bytes.
inline Vec LoadNibbles(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
#elif defined(__AVX2__)
  int32_t four;
  std::memcpy(&four, p, sizeof(four));
  const __m128i bytes = _mm_cvtsi32_si128(four);
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
  const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
  const __m128i codes = _mm_unpacklo_epi8(low, high);  // element order
#endif
#if defined(__AVX512F__)
  return (Vec)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));
#elif defined(__AVX2__)
  return (Vec)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
#else
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = (p[i / 2] >> (4 * (i % 2))) & 0xF;
  return v;
#endif
}

// One nibble (the high one if `high`) of each of kLanes bytes, or of the first n < kLanes
// (zeros after, never touching memory past p + n): a transposed int4 key row, positions in lanes.
inline Vec LoadNibbleLanes(const uint8_t* p, bool high) {
#if defined(__AVX512F__)
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (Vec)_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(bytes, high ? 4 : 0), _mm512_set1_epi32(0xF)));
#elif defined(__AVX2__)
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return (Vec)_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(bytes, high ? 4 : 0), _mm256_set1_epi32(0xF)));
#else
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = (p[i] >> (high ? 4 : 0)) & 0xF;
  return v;
#endif
}
inline Vec LoadPartNibbleLanes(const uint8_t* p, bool high, int64_t n) {
  uint8_t part[kLanes] = {};
  std::memcpy(part, p, n);
  return LoadNibbleLanes(part, high);
}

template <typename T>
inline Vec LoadPartAs(const T* p, int64_t n) {
  T part[kLanes] = {};
  std::memcpy(part, p, n * sizeof(T));
  return LoadAs(part);
}


// Dot products along rows, kLanes rows at a time: accumulate row i's products in acc[BitReversed(i)],
// then SumEach(acc) folds the kLanes vector sums into one vector (lane i: row i's sum).

// Lane i of the result: the sum of a's block (of 2 * kHalf lanes) holding lane i folded in half
// if i is in its block's lower half, else b's.
template <int kHalf>
inline Vec Fold(Vec a, Vec b) {
  IVec x, y;  // constants once inlined: each shuffle is one instruction
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) {
    const bool low = i % (2 * kHalf) < kHalf;
    x[i] = low ? i : kLanes + i;
    y[i] = low ? i + kHalf : kLanes + i - kHalf;
  }
  return __builtin_shuffle(a, b, x) + __builtin_shuffle(a, b, y);
}

// Lane i of the result: the sum of the lanes of v[kBitReversed[i]] (v is overwritten). Folding
// pairs of vectors, then pairs of those, ... leaves the sums in bit-reversed order.
template <int kHalf = kLanes / 2>
inline Vec SumEach(Vec* v) {
  constexpr int n = 2 * kHalf;  // vectors left at this level
#pragma GCC unroll 16
  for (int i = 0; i < n / 2; ++i) v[i] = Fold<kHalf>(v[2 * i], v[2 * i + 1]);
  if constexpr (kHalf > 1) return SumEach<kHalf / 2>(v);
  else return v[0];
}

constexpr int BitReversed(int i) {
  int r = 0;
  for (int bit = 1; bit < kLanes; bit <<= 1) r = (r << 1) | ((i & bit) ? 1 : 0);
  return r;
}

// e^x for x <= 0 (scores minus their maximum), to about 2 ulp: x = n ln2 + r with |r| <= ln2 / 2,
// e^r by its degree-6 minimax polynomial, 2^n put in the exponent bits. Below -87, where e^x
// leaves the normal floats, it returns e^-87; a NaN stays NaN.
inline Vec Exp(Vec x) {
  x = x < Vec{} - 87.0f ? Vec{} - 87.0f : x;
  const Vec shifter = Vec{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const Vec n = (x * 1.44269504f + shifter) - shifter;
  const Vec r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  Vec p = Vec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const IVec bits = (__builtin_convertvector(n, IVec) + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace kvjax

#endif  // KVJAX_CSRC_SIMD_H_
