// kvjax's decode attention over KIVI's 4-bit layout (kvjax.cache.kivi), on the CPU: one query
// token per sequence against its keys quantized per channel and its values per token, read in
// place, and its last partial group of positions in float.
//
//   kvjax_kivi_attention  q [B, K, G, H], k [B, K, H / 2, S], v [B, K, S, H / 2], k_scale [B, K, S / 32, 2, H],
//                         v_scale [B, K, S, 2, H / 32], k_residual and v_residual [B, K, 32, H],
//                         valid int32 [B] -> out [B, K, G, H]
//
// q: the step's queries grouped by kv head, already scaled (float32). Codes are packed two to a
// byte along the channels (element 2j in the low nibble of byte j), the keys' transposed (byte
// row j: channels 2j and 2j + 1 of every position); a code c stands for
// (c - zero) * step. Keys: each channel's 32 consecutive positions share a step and zero point
// (k_scale: the group's H steps, then its H zero points); values: each position's 32-channel
// groups (v_scale: the position's H / 32 steps, then its zero points). Row b attends to its
// positions [0, valid[b]): the groups below valid[b] / 32 * 32 from the codes, the rest (fewer
// than 32) from the residuals, whose entry i is position valid[b] / 32 * 32 + i.
//
// For a key group: q . ((c - z) * step) = (q * step) . c - (q * step) . z, so the query is scaled
// by the group's steps once and the scores of kLanes positions (in vector lanes) accumulate from
// each byte row widened once for up to 8 query heads. Values: sum_s p_s step_s (c_s - z_s) accumulates
// p_s step_s c_s and p_s step_s z_s per 32-channel group. One task per (row, kv head).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using kvjax::Is;
using kvjax::WithConstant;
using kvjax::Exp;
using kvjax::kLanes;
using kvjax::Load;
using kvjax::LoadNibbles;
using kvjax::Store;
using kvjax::Vec;

constexpr int64_t kGroup = 32;  // kvjax.cache.codec.KIVI_GROUP

struct Shape {
  int64_t batch, kv_heads, groups, head_dim, slots;
};

struct Scratch {
  std::vector<float> scores;  // groups x the row's positions, padded to kLanes
  std::vector<float> scaled;  // groups x head_dim: the queries times a key group's steps
  std::vector<float> out;     // groups x head_dim: the values' sum
  std::vector<float> zeros;   // groups x head_dim / 32: the values' zero points' sum
};

constexpr int64_t kBlockHeads = 4;     // query heads whose value sums stay in registers together
constexpr int64_t kBlockChannels = 64;  // channels of a value row decoded at a time (two groups)

// The coded positions' weighted values for GB query heads over channels [h0, h0 + 64) (or to
// head_dim): acc[g, h] += sum_t p[g, t] step[t, h / 32] c[t, h] and zeros[g, h / 32] +=
// sum_t p[g, t] step[t, h / 32] zero[t, h / 32], each row's codes widened once for every head.
template <int GB>
void ValueBlock(const float* probs, int64_t probs_stride, const uint8_t* values, const float* v_scales, int64_t coded,
                int64_t h_dim, int64_t h0, float* acc, float* zeros) {
  constexpr int64_t kVectors = kBlockChannels / kLanes;
  const int64_t vectors = std::min(kBlockChannels, h_dim - h0) / kLanes, v_groups = h_dim / kGroup;
  const int64_t bytes = h_dim / 2, j0 = h0 / kGroup, groups = vectors * kLanes / kGroup;
  Vec sum[GB][kVectors] = {};
  float zero_sum[GB][kBlockChannels / kGroup] = {};
  for (int64_t t = 0; t < coded; ++t) {
    const uint8_t* row = values + t * bytes + h0 / 2;
    const float* step = v_scales + t * 2 * v_groups + j0;
    __builtin_prefetch(row + 16 * bytes);
    Vec c[kVectors];
    for (int64_t i = 0; i < vectors; ++i) c[i] = LoadNibbles(row + i * kLanes / 2);
    for (int g = 0; g < GB; ++g) {
      const float p = probs[g * probs_stride + t];
      for (int64_t j = 0; j < groups; ++j) {
        const float w = p * step[j];
        zero_sum[g][j] += w * step[v_groups + j];
        for (int64_t i = j * kGroup / kLanes; i < (j + 1) * kGroup / kLanes; ++i) sum[g][i] += w * c[i];
      }
    }
  }
  for (int g = 0; g < GB; ++g) {
    for (int64_t i = 0; i < vectors; ++i) Store(acc + g * h_dim + h0 + i * kLanes, sum[g][i]);
    for (int64_t j = 0; j < groups; ++j) zeros[g * v_groups + j0 + j] = zero_sum[g][j];
  }
}

constexpr int64_t kKeyHeads = 8;  // query heads whose key scores stay in registers together

// scores[g, t0:t0 + kLanes] = scaled[g] . (the codes of positions t0..) - bias[g] for GB query
// heads (scores' rows `stride` apart), positions in lanes: each byte row of the transposed codes
// (channels h and h + 1 of kLanes positions) is widened once for every head.
template <int GB>
void KeyTile(const float* scaled, const float* bias, const uint8_t* keys, int64_t slots, int64_t t0, int64_t h_dim,
             float* scores, int64_t stride) {
  Vec acc[GB] = {};
  for (int64_t h = 0; h < h_dim; h += 2) {
    const uint8_t* row = keys + h / 2 * slots + t0;
    __builtin_prefetch(row + 4 * kLanes);
    const Vec low = kvjax::LoadNibbleLanes(row, false), high = kvjax::LoadNibbleLanes(row, true);
    for (int g = 0; g < GB; ++g) acc[g] += scaled[g * h_dim + h] * low + scaled[g * h_dim + h + 1] * high;
  }
  for (int g = 0; g < GB; ++g) Store(scores + g * stride + t0, acc[g] - bias[g]);
}

void Task(const Shape& s, const float* q, const uint8_t* k, const float* k_scale, const uint8_t* v,
          const float* v_scale, const float* k_res, const float* v_res, const int32_t* valid, float* out, int64_t b,
          int64_t kv, Scratch& scratch) {
  const int64_t h_dim = s.head_dim, bytes = h_dim / 2, pair = b * s.kv_heads + kv;
  const int64_t len = std::clamp<int64_t>(valid[b], 0, s.slots), coded = len / kGroup * kGroup;
  const int64_t padded = (len + kLanes - 1) / kLanes * kLanes, v_groups = h_dim / kGroup;
  const float* qp = q + pair * s.groups * h_dim;
  float* op = out + pair * s.groups * h_dim;
  if (len == 0) {
    std::fill(op, op + s.groups * h_dim, 0.0f);
    return;
  }
  scratch.scores.assign(s.groups * padded, -std::numeric_limits<float>::infinity());
  float* scores = scratch.scores.data();

  // Scores of the coded groups, kLanes positions at a time, positions in lanes.
  const uint8_t* keys = k + pair * bytes * s.slots;
  float* scaled = scratch.scaled.data();
  float bias[64];  // per query head: (q * step) . zero over the group (groups <= 64, checked)
  for (int64_t g0 = 0; g0 < coded; g0 += kGroup) {
    const float* step = k_scale + (pair * (s.slots / kGroup) + g0 / kGroup) * 2 * h_dim;
    const float* zero = step + h_dim;
    for (int64_t g = 0; g < s.groups; ++g) {
      Vec acc{};
      for (int64_t h = 0; h < h_dim; h += kLanes) {
        const Vec x = Load(qp + g * h_dim + h) * Load(step + h);
        Store(scaled + g * h_dim + h, x);
        acc += x * Load(zero + h);
      }
      bias[g] = 0;
      for (int i = 0; i < kLanes; ++i) bias[g] += acc[i];
    }
    for (int64_t t0 = g0; t0 < g0 + kGroup; t0 += kLanes)
      for (int64_t h0 = 0; h0 < s.groups; h0 += kKeyHeads) {
        WithConstant<kKeyHeads>(std::min(kKeyHeads, s.groups - h0), [&](auto n) {
          KeyTile<decltype(n)::value>(scaled + h0 * h_dim, bias + h0, keys, s.slots, t0, h_dim, scores + h0 * padded,
                                      padded);
        });
      }
  }
  // The residual's positions, in float.
  const float* k_rows = k_res + pair * kGroup * h_dim;
  for (int64_t t = coded; t < len; ++t)
    for (int64_t g = 0; g < s.groups; ++g) {
      Vec acc{};
      for (int64_t h = 0; h < h_dim; h += kLanes) acc += Load(qp + g * h_dim + h) * Load(k_rows + (t - coded) * h_dim + h);
      float sum = 0;
      for (int i = 0; i < kLanes; ++i) sum += acc[i];
      scores[g * padded + t] = sum;
    }

  // Softmax weights, unnormalised (positions past len: weight 0).
  float total[64];
  for (int64_t g = 0; g < s.groups; ++g) {
    float* row = scores + g * padded;
    const float top = *std::max_element(row, row + len);
    for (int64_t t = 0; t < padded; t += kLanes) Store(row + t, Exp(Load(row + t) - top));
    std::fill(row + len, row + padded, 0.0f);  // Exp's floor is e^-87, not 0
    Vec sum{};
    for (int64_t t = 0; t < padded; t += kLanes) sum += Load(row + t);
    total[g] = 0;
    for (int i = 0; i < kLanes; ++i) total[g] += sum[i];
  }

  // Values: the coded positions' codes and zero points weighted apart, then the residual's.
  scratch.out.assign(s.groups * h_dim, 0.0f);
  scratch.zeros.assign(s.groups * v_groups, 0.0f);
  float* acc = scratch.out.data();
  float* zeros = scratch.zeros.data();
  const uint8_t* values = v + pair * s.slots * bytes;
  const float* v_scales = v_scale + pair * s.slots * 2 * v_groups;
  for (int64_t h0 = 0; h0 < h_dim; h0 += kBlockChannels)
    for (int64_t g0 = 0; g0 < s.groups; g0 += kBlockHeads) {
      const int64_t heads = std::min(kBlockHeads, s.groups - g0);
      WithConstant<kBlockHeads>(heads, [&](auto n) {
        ValueBlock<decltype(n)::value>(scores + g0 * padded, padded, values, v_scales, coded, h_dim, h0,
                                       acc + g0 * h_dim, zeros + g0 * v_groups);
      });
    }
  const float* v_rows = v_res + pair * kGroup * h_dim;
  for (int64_t t = coded; t < len; ++t)
    for (int64_t g = 0; g < s.groups; ++g) {
      const float p = scores[g * padded + t];
      for (int64_t h = 0; h < h_dim; h += kLanes)
        Store(acc + g * h_dim + h, Load(acc + g * h_dim + h) + p * Load(v_rows + (t - coded) * h_dim + h));
    }
  for (int64_t g = 0; g < s.groups; ++g) {
    const float inverse = 1.0f / total[g];
    for (int64_t h = 0; h < h_dim; ++h) op[g * h_dim + h] = (acc[g * h_dim + h] - zeros[g * v_groups + h / kGroup]) * inverse;
  }
}

// Named types: the registration macro below splits its arguments at commas.
using Queries = ffi::Buffer<ffi::F32, 4>;
using Codes = ffi::Buffer<ffi::U8, 4>;
using KeyScales = ffi::Buffer<ffi::F32, 5>;
using Residual = ffi::Buffer<ffi::F32, 4>;
using Valid = ffi::Buffer<ffi::S32, 1>;
using Result = ffi::ResultBuffer<ffi::F32, 4>;

ffi::Error KiviAttention(ffi::ThreadPool pool, Queries q, Codes k, Codes v, KeyScales k_scale, KeyScales v_scale,
                         Residual k_res, Residual v_res, Valid valid, Result out) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  const Shape s{qd[0], qd[1], qd[2], qd[3], kd[3]};
  const int64_t h = s.head_dim;
  if (h % kGroup || h % kLanes || s.slots % kGroup || s.groups > 64 ||
      !Is(kd, {s.batch, s.kv_heads, h / 2, s.slots}) || !Is(v.dimensions(), {s.batch, s.kv_heads, s.slots, h / 2}) ||
      !Is(k_scale.dimensions(), {s.batch, s.kv_heads, s.slots / kGroup, 2, h}) ||
      !Is(v_scale.dimensions(), {s.batch, s.kv_heads, s.slots, 2, h / kGroup}) ||
      !Is(k_res.dimensions(), {s.batch, s.kv_heads, kGroup, h}) || !Is(v_res.dimensions(), {s.batch, s.kv_heads, kGroup, h}) ||
      !Is(valid.dimensions(), {s.batch}) || !Is(out->dimensions(), {s.batch, s.kv_heads, s.groups, h}))
    return ffi::Error::InvalidArgument(
        "kvjax_kivi_attention expects q [B, K, G, H] (G <= 64, H a multiple of 32 and of the vector width), "
        "k [B, K, H / 2, S] and v [B, K, S, H / 2] (S a multiple of 32), k_scale [B, K, S / 32, 2, H], v_scale [B, K, S, 2, H / 32], "
        "residuals [B, K, 32, H], valid [B] (kvjax/kernels/csrc/kivi_attention.cc)");
  const int64_t tasks = s.batch * s.kv_heads;
  if (tasks == 0) return ffi::Error::Success();
  const int64_t workers = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), tasks);
  std::vector<Scratch> scratch(workers);
  for (auto& sc : scratch) {
    sc.scaled.resize(s.groups * h);
  }
  kvjax::ParallelFor(pool, tasks, workers, [&](int64_t task, int64_t worker) {
    Task(s, q.typed_data(), k.typed_data(), k_scale.typed_data(), v.typed_data(), v_scale.typed_data(),
         k_res.typed_data(), v_res.typed_data(), valid.typed_data(), out->typed_data(), task / s.kv_heads,
         task % s.kv_heads, scratch[worker]);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxKiviAttention, KiviAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Queries>()
                                  .Arg<Codes>()
                                  .Arg<Codes>()
                                  .Arg<KeyScales>()
                                  .Arg<KeyScales>()
                                  .Arg<Residual>()
                                  .Arg<Residual>()
                                  .Arg<Valid>()
                                  .Ret<Queries>());
