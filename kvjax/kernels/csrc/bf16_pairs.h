// Products of bfloat16 pairs for the small-matmul kernel's stored weight formats, on CPUs with
// AVX512_BF16 (Zen 4, Sapphire Rapids and later).
//
// The stored formats multiply activations rounded to bfloat16 by weights that are bfloat16 or
// int8 (exact in bfloat16), accumulating in float32 (kvjax/numerics.py). vdpbf16ps does that for
// 32 bfloat16 pairs in one instruction: each float32 lane adds a[2i] * b[2i] + a[2i + 1] * b[2i + 1],
// the products exact in float32. Widening the weights to float32 first and using FMAs costs twice
// the multiplies plus the widening, which at batch 8 makes the step compute-bound: the stored
// formats then ran no faster than float32. The lanes pair along the contraction axis, so a [K, N]
// matrix's rows k and k + 1 are interleaved column by column (PairsOf); a transposed [N, K]
// matrix's rows already hold their pairs in order (RowOf). Activations arrive as bfloat16 bits,
// [M, K] with K even (a zero appended to odd rows), read as one uint32 per pair.

#ifndef KVJAX_CSRC_BF16_PAIRS_H_
#define KVJAX_CSRC_BF16_PAIRS_H_

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVJAX_BF16_PAIRS 1

#include <immintrin.h>

#include <cstdint>

namespace kvjax {

// The first n <= 16 (Mask16) or n <= 32 (Mask32) lanes.
inline __mmask16 Mask16(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }
inline __mmask32 Mask32(int64_t n) { return n >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << n) - 1); }

// Word 2j of the result takes word j of a, word 2j + 1 takes word j of b (vpermt2w's indices).
inline __m512i InterleaveWords() {
  alignas(64) static const uint16_t kIndex[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                  8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  return _mm512_load_si512(kIndex);
}

// 16 pairs (w0[j], w1[j]) for j < width (zeros past it): lane j of a [K, N] matrix's rows k, k + 1.
inline __m512bh PairsOf(const uint16_t* w0, const uint16_t* w1, int64_t width, __m512i interleave) {
  const __mmask16 mask = Mask16(width);
  const __m512i a = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(mask, w0));
  const __m512i b = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(mask, w1));
  return (__m512bh)_mm512_permutex2var_epi16(a, interleave, b);
}

inline __m512bh PairsOf(const int8_t* w0, const int8_t* w1, int64_t width, __m512i) {
  const __mmask16 mask = Mask16(width);
  const __m128i a = _mm_maskz_loadu_epi8(mask, w0), b = _mm_maskz_loadu_epi8(mask, w1);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(a, b)));  // pairs of lanes 0..7
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(a, b)));  // 8..15
  return _mm512_cvtne2ps_pbh(hi, lo);  // lo's words first
}

// The first n <= 32 values of a row as bfloat16, in order (zeros past n).
inline __m512bh RowOf(const uint16_t* w, int64_t n) {
  return (__m512bh)_mm512_maskz_loadu_epi16(Mask32(n), w);
}

inline __m512bh RowOf(const int8_t* w, int64_t n) {
  const __m256i bytes = _mm256_maskz_loadu_epi8(Mask32(n), w);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

}  // namespace kvjax

#endif  // __AVX512BF16__
#endif  // KVJAX_CSRC_BF16_PAIRS_H_
