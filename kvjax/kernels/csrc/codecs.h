// How kvjax's CPU kernels read each cache codec's storage (kvjax.cache.codec): the stored element
// type names the codec, and Storage<T> says how its values are scaled.
//
//   float, BFloat16, Float16   the value itself, widened to float as it is loaded
//   int8_t, Float8E4M3         value * scale, one float32 scale per stored vector: the kernel
//                              applies it to a position's score (keys) and softmax weight (values)
//                              (fp8's scaled by kUnit, as its loads are)
//   uint8_t (int4)             two codes a byte (element 2j in the low nibble of byte j), and per
//                              vector G groups of H / G elements with a step and a zero point
//                              (float32 [2G]: the G steps, then the G zero points):
//                              x = (code - zero) * step, computed element by element as XLA's
//                              decode computes it

#ifndef KVJAX_CSRC_CODECS_H_
#define KVJAX_CSRC_CODECS_H_

#include <cstdint>
#include <type_traits>

#include "simd.h"

namespace kvjax {

template <typename T>
struct Storage {
  static constexpr bool kScaled = std::is_same_v<T, int8_t> || std::is_same_v<T, Float8E4M3>;
  static constexpr bool kGrouped = std::is_same_v<T, uint8_t>;
  static constexpr int64_t kPerEntry = kGrouped ? 2 : 1;  // elements per stored entry
  // What a scale is multiplied by: fp8 loads as its value x 2^-8 (simd.h), one instruction fewer
  // per vector, and the power of two leaves every product's rounding as it was.
  static constexpr float kUnit = std::is_same_v<T, Float8E4M3> ? 256.0f : 1.0f;
};

// out[0:head_dim] = an int4 vector decoded: codes [head_dim / 2] bytes, scale [2 * groups].
inline void DecodeInt4(const uint8_t* codes, const float* scale, int64_t head_dim, int64_t groups, float* out) {
  const int64_t size = head_dim / groups;  // elements per group, even
  if (size % kLanes == 0) {
    for (int64_t g = 0; g < groups; ++g) {
      const Vec step = Vec{} + scale[g], zero = Vec{} + scale[groups + g];
      for (int64_t h = g * size; h < (g + 1) * size; h += kLanes) Store(out + h, (LoadNibbles(codes + h / 2) - zero) * step);
    }
    return;
  }
  for (int64_t h = 0; h < head_dim; ++h) {
    const float code = (codes[h / 2] >> (4 * (h % 2))) & 0xF;
    out[h] = (code - scale[groups + h / size]) * scale[h / size];
  }
}

}  // namespace kvjax

#endif  // KVJAX_CSRC_CODECS_H_
