// Float vectors for kvjax's CPU kernels: 16 lanes with AVX-512, else 8 (AVX2 and others), as
// GCC vector extensions, with loads and stores of the first n < kLanes lanes, loads of int8 data
// as floats, and gathers.

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
typedef int8_t Bytes __attribute__((vector_size(kLanes)));

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

// kLanes elements of float or int8 data as floats (LoadAs), or the first n < kLanes of them,
// zeros after (LoadPartAs, never touching memory past p + n).
inline Vec LoadAs(const float* p) { return Load(p); }
inline Vec LoadPartAs(const float* p, int64_t n) { return LoadPart(p, n); }
inline Vec LoadAs(const int8_t* p) {
  Bytes b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, Vec);
}
inline Vec LoadPartAs(const int8_t* p, int64_t n) {
  Bytes b = {};
  std::memcpy(&b, p, n);
  return __builtin_convertvector(b, Vec);
}

// Lane i is base[offsets[i]], as a float.
inline Vec Gather(const float* base, IVec offsets) {
#if defined(__AVX512F__)
  return (Vec)_mm512_i32gather_ps((__m512i)offsets, base, 4);
#elif defined(__AVX2__)
  return (Vec)_mm256_i32gather_ps(base, (__m256i)offsets, 4);
#else
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = base[offsets[i]];
  return v;
#endif
}

// int8: each lane reads the aligned 4-byte word that holds its byte (so never memory past the
// buffer's last word), then shifts the byte out, sign-extended (little-endian).
inline Vec Gather(const int8_t* base, IVec offsets) {
#if defined(__AVX512F__) || defined(__AVX2__)
  const uintptr_t address = reinterpret_cast<uintptr_t>(base);
  const void* words = reinterpret_cast<const void*>(address & ~uintptr_t{3});
  const IVec at = offsets + static_cast<int32_t>(address & 3);
#if defined(__AVX512F__)
  IVec w = (IVec)_mm512_i32gather_epi32((__m512i)(at & ~3), words, 1);
#else
  IVec w = (IVec)_mm256_i32gather_epi32(static_cast<const int*>(words), (__m256i)(at & ~3), 1);
#endif
  w = (w << ((3 - (at & 3)) * 8)) >> 24;
  return __builtin_convertvector(w, Vec);
#else
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = base[offsets[i]];
  return v;
#endif
}

}  // namespace kvjax

#endif  // KVJAX_CSRC_SIMD_H_
