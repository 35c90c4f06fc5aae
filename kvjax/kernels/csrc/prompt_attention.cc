// kvjax's prompt attention: every query of a call against keys given by their positions (a
// prefill's own keys, or a cache's slots and the call's new keys), on the CPU, in float32, as
// kvjax.model.keys.attend_keys computes it in XLA.
//
//   kvjax_prompt_attention   q [B, T, N, H], k [B, K, S, H] (k_transposed: [B, K, H, S]),
//                            v [B, K, S, H], q_pos int32 [B, T], k_pos int32 [B, K, S] (per kv head;
//                            negative: no key there); attributes window, sinks, k_transposed
//                            -> out [B, T, N, H] float32
//
// Query head n reads kv head n / (N / K). A query at position p reads the key at position s when
// 0 <= s <= p and, in a window (window > 0), p - s < window or s < sinks (kvjax.model.keys.visible);
// a query that reads no key gives zeros.
//
// A task is one query head of one row over kRows consecutive queries, held transposed (queries in
// vector lanes), so that scores, the softmax's running maximum and sum, and the output all work on
// whole vectors with no horizontal sums: scores of kKeys keys at a time from the keys' rows
// (broadcast against the query lanes), a tile of kTile keys at a time with an online softmax, and
// the weighted values accumulated into the transposed output, kHeadBlock channels at a time. Key
// tiles that no query of the task may read (above the causal diagonal, outside every window) are
// skipped, those that every query reads whole are not masked, and the others are masked element
// by element. Tasks are claimed longest first (the last
// queries read the most keys).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using kvjax::Is;
using kvjax::Exp;
using kvjax::IVec;
using kvjax::kLanes;
using kvjax::Load;
using kvjax::Store;
using kvjax::Vec;

constexpr int64_t kVectors = 4;               // query vectors per task
constexpr int64_t kRows = kVectors * kLanes;  // queries per task
constexpr int64_t kKeys = 4;                  // keys per score step
constexpr int64_t kTile = 64;                 // keys per softmax tile
constexpr int64_t kHeadBlock = 4;             // channels per output step
constexpr float kNone = -1e30f;               // a masked score: below every real one, finite

struct Shape {
  int64_t batch, queries, heads, head_dim, kv_heads, keys, window, sinks;
  bool k_transposed;
  int64_t blocks() const { return (queries + kRows - 1) / kRows; }
};

struct Scratch {
  std::vector<float> qt, scores, out;  // [H][kRows], [kTile][kRows], [H][kRows]
  explicit Scratch(int64_t head_dim) : qt(head_dim * kRows), scores(kTile * kRows), out(head_dim * kRows) {}
};

IVec Broadcast(int32_t x) { return IVec{} + x; }

void Task(const Shape& s, const float* q, const float* k, const float* v, const int32_t* q_pos, const int32_t* k_pos,
          float* out, int64_t b, int64_t n, int64_t block, Scratch& w) {
  const int64_t h_dim = s.head_dim, t0 = block * kRows, rows = std::min(kRows, s.queries - t0);
  const int64_t kv = n / (s.heads / s.kv_heads);
  const float scale = 1.0f / std::sqrt(float(h_dim));
  float* qt = w.qt.data();
  float* st = w.scores.data();
  float* ot = w.out.data();
  alignas(64) int32_t positions[kRows];
  int32_t first = std::numeric_limits<int32_t>::max(), last = -1;
  bool every_row = rows == kRows;  // every lane a query with a position (none of them padding)
  for (int64_t i = 0; i < kRows; ++i) {
    const bool real = i < rows;
    positions[i] = real ? q_pos[b * s.queries + t0 + i] : -1;
    if (positions[i] >= 0) first = std::min(first, positions[i]), last = std::max(last, positions[i]);
    every_row &= positions[i] >= 0;
    const float* row = q + ((b * s.queries + t0 + i) * s.heads + n) * h_dim;
    for (int64_t h = 0; h < h_dim; ++h) qt[h * kRows + i] = real ? row[h] * scale : 0.0f;
  }
  std::fill(ot, ot + h_dim * kRows, 0.0f);
  IVec qp[kVectors];
  Vec m[kVectors], l[kVectors];
  for (int64_t r = 0; r < kVectors; ++r) {
    std::memcpy(&qp[r], positions + r * kLanes, sizeof(IVec));
    m[r] = Vec{} + kNone;
    l[r] = Vec{};
  }
  const float* keys = k + (b * s.kv_heads + kv) * s.keys * h_dim;
  const float* values = v + (b * s.kv_heads + kv) * s.keys * h_dim;
  const int32_t* kp = k_pos + (b * s.kv_heads + kv) * s.keys;
  // Key j's channel h: keys[j * key_step + h * channel_step].
  const int64_t key_step = s.k_transposed ? 1 : h_dim, channel_step = s.k_transposed ? s.keys : 1;
  for (int64_t j0 = 0; last >= 0 && j0 < s.keys; j0 += kTile) {
    const int64_t count = std::min(kTile, s.keys - j0);
    int32_t low = std::numeric_limits<int32_t>::max(), high = -1;
    bool sink = false;
    int64_t held = 0;
    for (int64_t j = 0; j < count; ++j) {
      const int32_t p = kp[j0 + j];
      if (p < 0) continue;
      low = std::min(low, p), high = std::max(high, p);
      sink |= p < s.sinks;
      ++held;
    }
    if (high < 0 || low > last) continue;  // no key, or every key after every query
    if (s.window > 0 && !sink && int64_t{high} <= int64_t{first} - s.window) continue;  // behind every window
    // Every query reads every key of the tile (below the causal diagonal, inside every window):
    // no mask to apply.
    const bool whole = every_row && held == count && high <= first &&
                       (s.window == 0 || int64_t{last} - int64_t{low} < s.window || int64_t{high} < s.sinks);
    // Scores, kKeys keys at a time (keys past the tile's end read key 0 and are masked).
    const int64_t padded = (count + kKeys - 1) / kKeys * kKeys;
    for (int64_t j = 0; j < padded; j += kKeys) {
      Vec acc[kKeys][kVectors] = {};
      const float* rows_k[kKeys];
      for (int64_t jj = 0; jj < kKeys; ++jj) rows_k[jj] = keys + (j0 + (j + jj < count ? j + jj : 0)) * key_step;
      for (int64_t h = 0; h < h_dim; ++h) {
        Vec qv[kVectors];
        for (int64_t r = 0; r < kVectors; ++r) qv[r] = Load(qt + h * kRows + r * kLanes);
        for (int64_t jj = 0; jj < kKeys; ++jj) {
          const float key = rows_k[jj][h * channel_step];
          for (int64_t r = 0; r < kVectors; ++r) acc[jj][r] += qv[r] * key;
        }
      }
      for (int64_t jj = 0; jj < kKeys; ++jj)
        for (int64_t r = 0; r < kVectors; ++r) Store(st + (j + jj) * kRows + r * kLanes, acc[jj][r]);
    }
    // The mask, the tile's maximum and the online softmax.
    Vec top[kVectors];
    for (int64_t r = 0; r < kVectors; ++r) top[r] = m[r];
    for (int64_t j = 0; j < count; ++j) {
      const int32_t p = kp[j0 + j];
      for (int64_t r = 0; r < kVectors; ++r) {
        Vec x = Load(st + j * kRows + r * kLanes);
        if (!whole) {
          IVec seen = (Broadcast(p) >= 0) & (Broadcast(p) <= qp[r]);
          if (s.window > 0 && p >= s.sinks) seen &= (qp[r] - p) < Broadcast(int32_t(s.window));
          x = seen ? x : Vec{} + kNone;
          Store(st + j * kRows + r * kLanes, x);
        }
        top[r] = x > top[r] ? x : top[r];
      }
    }
    for (int64_t r = 0; r < kVectors; ++r) {
      const Vec fix = Exp(m[r] - top[r]);
      Vec sum = Vec{};
      for (int64_t j = 0; j < count; ++j) {
        const Vec x = Load(st + j * kRows + r * kLanes);
        const Vec e = x > Vec{} + kNone ? Exp(x - top[r]) : Vec{};
        Store(st + j * kRows + r * kLanes, e);
        sum += e;
      }
      l[r] = l[r] * fix + sum;
      m[r] = top[r];
      for (int64_t h = 0; h < h_dim; ++h) Store(ot + h * kRows + r * kLanes, Load(ot + h * kRows + r * kLanes) * fix);
    }
    // The weighted values, kHeadBlock channels at a time.
    for (int64_t h0 = 0; h0 < h_dim; h0 += kHeadBlock) {
      Vec acc[kHeadBlock][kVectors];
      for (int64_t hh = 0; hh < kHeadBlock; ++hh)
        for (int64_t r = 0; r < kVectors; ++r) acc[hh][r] = Load(ot + (h0 + hh) * kRows + r * kLanes);
      for (int64_t j = 0; j < count; ++j) {
        Vec pv[kVectors];
        for (int64_t r = 0; r < kVectors; ++r) pv[r] = Load(st + j * kRows + r * kLanes);
        const float* row = values + (j0 + j) * h_dim + h0;
        for (int64_t hh = 0; hh < kHeadBlock; ++hh) {
          const float value = row[hh];
          for (int64_t r = 0; r < kVectors; ++r) acc[hh][r] += pv[r] * value;
        }
      }
      for (int64_t hh = 0; hh < kHeadBlock; ++hh)
        for (int64_t r = 0; r < kVectors; ++r) Store(ot + (h0 + hh) * kRows + r * kLanes, acc[hh][r]);
    }
  }
  alignas(64) float total[kRows];
  for (int64_t r = 0; r < kVectors; ++r) Store(total + r * kLanes, l[r]);
  for (int64_t i = 0; i < rows; ++i) {
    float* row = out + ((b * s.queries + t0 + i) * s.heads + n) * h_dim;
    const float inverse = total[i] > 0.0f ? 1.0f / total[i] : 0.0f;
    for (int64_t h = 0; h < h_dim; ++h) row[h] = ot[h * kRows + i] * inverse;
  }
}

// Named types: the registration macro below splits its arguments at commas.
using Array4 = ffi::Buffer<ffi::F32, 4>;
using Positions = ffi::Buffer<ffi::S32, 2>;
using HeadPositions = ffi::Buffer<ffi::S32, 3>;
using Result4 = ffi::ResultBuffer<ffi::F32, 4>;

ffi::Error PromptAttention(ffi::ThreadPool pool, Array4 q, Array4 k, Array4 v, Positions q_pos, HeadPositions k_pos,
                           int64_t window, int64_t sinks, int64_t k_transposed, Result4 out) {
  const auto qd = q.dimensions(), vd = v.dimensions();
  const Shape s{qd[0], qd[1], qd[2], qd[3], vd[1], vd[2], window, sinks, k_transposed != 0};
  const bool keys_fit = s.k_transposed ? Is(k.dimensions(), {s.batch, s.kv_heads, s.head_dim, s.keys})
                                       : Is(k.dimensions(), {s.batch, s.kv_heads, s.keys, s.head_dim});
  if (!keys_fit || !Is(vd, {s.batch, s.kv_heads, s.keys, s.head_dim}) ||
      !Is(q_pos.dimensions(), {s.batch, s.queries}) || !Is(k_pos.dimensions(), {s.batch, s.kv_heads, s.keys}) ||
      !Is(out->dimensions(), {s.batch, s.queries, s.heads, s.head_dim}) || s.kv_heads == 0 || s.heads % s.kv_heads ||
      s.head_dim % kHeadBlock || window < 0 || sinks < 0)
    return ffi::Error::InvalidArgument(
        "kvjax_prompt_attention expects q [B, T, N, H], k [B, K, S, H] (transposed: [B, K, H, S]) and v [B, K, S, H] "
        "with K dividing N and H a multiple of 4, q_pos [B, T], k_pos [B, K, S] (kvjax/kernels/csrc/prompt_attention.cc)");
  const int64_t per_block = s.batch * s.heads, tasks = per_block * s.blocks();
  if (tasks == 0) return ffi::Error::Success();
  const int64_t workers = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), tasks);
  std::vector<Scratch> scratch(workers, Scratch(s.head_dim));
  kvjax::ParallelFor(pool, tasks, workers, [&](int64_t task, int64_t worker) {
    const int64_t block = s.blocks() - 1 - task / per_block;  // the last queries, which read the most keys, first
    const int64_t pair = task % per_block;
    Task(s, q.typed_data(), k.typed_data(), v.typed_data(), q_pos.typed_data(), k_pos.typed_data(), out->typed_data(),
         pair / s.heads, pair % s.heads, block, scratch[worker]);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxPromptAttention, PromptAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Array4>()
                                  .Arg<Array4>()
                                  .Arg<Array4>()
                                  .Arg<Positions>()
                                  .Arg<HeadPositions>()
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("sinks")
                                  .Attr<int64_t>("k_transposed")
                                  .Ret<Array4>());
