// Float vectors for kvjax's CPU kernels: 16 lanes with AVX-512, else 8 (AVX2 and others), as
// GCC vector extensions, with loads and stores of the first n < kLanes lanes, and loads of int8
// data as floats.

#ifndef KVJAX_CSRC_SIMD_H_
#define KVJAX_CSRC_SIMD_H_

#include <cstdint>
#include <cstring>

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

// kLanes elements of float, int8 or bfloat16 data as floats (LoadAs), or the first n < kLanes of them,
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
template <typename T>
inline Vec LoadPartAs(const T* p, int64_t n) {
  T part[kLanes] = {};
  std::memcpy(part, p, n * sizeof(T));
  return LoadAs(part);
}


}  // namespace kvjax

#endif  // KVJAX_CSRC_SIMD_H_
