// kvjax's decode attention: one query token per sequence attends to its cached keys and values,
// on the CPU. One kernel, templated over the stored type (codecs.h), and one XLA FFI target per
// cache layout and codec (kvjax.cache.codec), by how the cache stores them:
//
//   kvjax_decode_attention{codec}   q, k [B, K, H', S] (transposed), v [B, K, S, H'], (scales), valid -> out
//   kvjax_paged_attention{codec}    q, k pool [K, P, Z, H'], v pool [K, P, Z, H'], (scales), page_table [B, M], valid
//
//   codec    stored as      H'     scales (k_scale, v_scale, float32)
//   (none)   float32        H      none
//   _bf16    bfloat16       H      none
//   _f16     float16        H      none
//   _int8    int8           H      one per (position, kv head): [B, K, S], paged [K, P, Z]
//   _fp8     float8_e4m3fn  H      as int8
//   _int4    uint8 (2 codes) H / 2  steps and zero points of G groups: k [B, K, 2G, S] (transposed
//                                  like the keys), v [B, K, S, 2G], paged both [K, P, Z, 2G]
//
//   q      [B, K, G, H]  the step's queries, grouped by kv head and already scaled (float32),
//   valid  int32 [B]     how many cached positions each row attends to (its length + 1),
//   out    [B, K, G, H]  float32.
// Paged: entry j of row b's page table is the page holding its positions [j*Z, (j+1)*Z); pages
// are read in place. Every element is widened to float as it is read; one scale per vector
// (int8, fp8) is applied to the scores (keys) and to the softmax weights (values), so a step
// reads the stored bytes and nothing else. int4 takes each group's step and zero point once per
// group: q . ((c - z) * step) = step * (q . c - z * sum(q)) for transposed keys, and for values
// whose groups are whole vectors of bytes sum_s w c - sum_s w z with w = p * step; paged keys (and
// values of other group sizes) are decoded, (c - z) * step, a tile of rows at a time.
//
// Each (row, kv head) pair is cut into chunks of positions; a task reads a chunk's keys once for
// up to 8 query heads (contiguous keys, transposed: scores as [G, H] x [H, chunk] with positions in
// vector lanes; paged keys: dot products along their rows, for one query head at a time),
// takes the softmax in a per-thread buffer that stays in cache, and reads the chunk's value rows
// once; the chunks of a pair are merged afterwards (the split softmax of flash decoding). Only
// positions below valid[b] are read: XLA's masked attention reads the whole preallocated cache,
// and over pages a gathered copy of it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "codecs.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using kvjax::Is;
using kvjax::WithConstant;
using kvjax::BFloat16;
using kvjax::BitReversed;
using kvjax::Exp;
using kvjax::Float16;
using kvjax::Float8E4M3;
using kvjax::IVec;
using kvjax::kLanes;
using kvjax::Load;
using kvjax::LoadAs;
using kvjax::LoadPart;
using kvjax::LoadPartAs;
using kvjax::Store;
using kvjax::Storage;
using kvjax::StorePart;
using kvjax::SumEach;
using kvjax::Vec;

constexpr int64_t kScoreVectors = 4;  // positions per score tile, in vectors
constexpr int64_t kScoreGroups = 8;   // query heads per register tile of scores
constexpr int64_t kValueGroups = 8;   // query heads per register tile of outputs
constexpr int64_t kMinChunk = 256;    // positions: shorter chunks read their key rows in shorter runs
constexpr int64_t kMaxChunk = 2048;   // positions: a chunk's scores (G x chunk floats) stay in L2
constexpr int64_t kTasksPerThread = 4;
constexpr int64_t kValueBlock = 64;  // int4: value rows decoded at a time (16 KB at H = 64)
// Software prefetch distances, in stored entries. The hardware prefetcher alone leaves the loops
// waiting on memory when many query heads share each cached row (the value loop's single stream,
// and the key tile's head_dim rows of stride max_len). A prefetch past a buffer's end never faults.
constexpr int64_t kKeyPrefetch = 64;      // along each key row: 1-2 score tiles at 16 lanes (256 B in float32)
constexpr int64_t kValuePrefetch = 1024;  // down the contiguous values: 16 rows of 64 (4 KB in float32)
constexpr int64_t kRowsAhead = 16;        // down the paged values, in rows
constexpr int64_t kKeyRowsAhead = 2 * kLanes;  // down the paged keys, in rows (two tiles)

inline float Max(Vec v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

inline float Sum(Vec v) {
  float s = 0;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// Contiguous keys are stored transposed ([H, S] with row stride max_len), so that positions lie in
// vector lanes. Load(h, kv) sets kv[j], j < NV, to entry h of the kLanes * NV keys from position
// s, vector j holding positions s + kLanes * j onwards. kEdge: the tile reaches past max_len,
// whose positions read as zero. (Whether a load is partial
// is decided at compile time: a choice made in the loop keeps the accumulators out of registers.)
template <typename T, int NV, bool kEdge>
struct TransposedKeys {
  const T* keys;
  int64_t max_len, s;
  void Load(int64_t h, Vec* kv) const {
    const T* row = keys + h * max_len + s;
    for (int j = 0; j < NV; ++j) __builtin_prefetch(row + kLanes * j + kKeyPrefetch);
    for (int j = 0; j < NV; ++j) {
      const int64_t left = max_len - s - kLanes * j;
      kv[j] = !kEdge || left >= kLanes ? LoadAs(row + kLanes * j) : left > 0 ? LoadPartAs(row + kLanes * j, left) : Vec{};
    }
  }
};

// Transposed int4 keys [H / 2, S] (byte row h / 2 holds elements h and h + 1 of each position,
// in its low and high nibbles) with scales [2G, S] (each position's steps, then its zero points):
// scores[g, 0:NV*kLanes] for GB query heads, a group of elements at a time, as
// q . ((c - z) * step) = step * (q . c - z * sum(q)) over the group: each byte row is widened once
// for two elements and every query head, the step and zero point once per group. q_sums[g * G + i]:
// query head g's sum over group i. kEdge: the tile reaches past max_len (zeros there).
template <int GB, int NV, bool kEdge>
void Int4ScoreTile(const float* q, const float* q_sums, const uint8_t* keys, const float* scales, float* scores,
                   int64_t head_dim, int64_t groups, int64_t max_len, int64_t s, int64_t scores_stride) {
  const int64_t size = head_dim / groups;
  auto lanes = [&](int j) { return kEdge ? std::min<int64_t>(kLanes, std::max<int64_t>(0, max_len - s - kLanes * j)) : kLanes; };
  Vec acc[GB][NV] = {};
  for (int64_t group = 0; group < groups; ++group) {
    Vec part[GB][NV] = {};
    for (int64_t h = group * size; h < (group + 1) * size; h += 2) {
      const uint8_t* row = keys + h / 2 * max_len + s;
      for (int j = 0; j < NV; ++j) __builtin_prefetch(row + kLanes * j + kKeyPrefetch);
      Vec low[NV], high[NV];
      for (int j = 0; j < NV; ++j) {
        const int64_t n = lanes(j);
        low[j] = n == kLanes ? kvjax::LoadNibbleLanes(row + kLanes * j, false)
                 : n > 0     ? kvjax::LoadPartNibbleLanes(row + kLanes * j, false, n)
                             : Vec{};
        high[j] = n == kLanes ? kvjax::LoadNibbleLanes(row + kLanes * j, true)
                  : n > 0     ? kvjax::LoadPartNibbleLanes(row + kLanes * j, true, n)
                              : Vec{};
      }
      for (int g = 0; g < GB; ++g) {
        const float q_low = q[g * head_dim + h], q_high = q[g * head_dim + h + 1];
        for (int j = 0; j < NV; ++j) part[g][j] += q_low * low[j] + q_high * high[j];
      }
    }
    const float* step = scales + group * max_len + s;
    const float* zero = step + groups * max_len;
    for (int j = 0; j < NV; ++j) {
      const int64_t n = lanes(j);
      const Vec st = n == kLanes ? kvjax::Load(step + kLanes * j) : n > 0 ? kvjax::LoadPart(step + kLanes * j, n) : Vec{};
      const Vec z = n == kLanes ? kvjax::Load(zero + kLanes * j) : n > 0 ? kvjax::LoadPart(zero + kLanes * j, n) : Vec{};
      for (int g = 0; g < GB; ++g) acc[g][j] += st * (part[g][j] - z * q_sums[g * groups + group]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < NV; ++j) Store(scores + g * scores_stride + kLanes * j, acc[g][j]);
}

// scores[g, 0:NV*kLanes] = q[g] . (the tile's keys) for GB query heads.
template <int GB, int NV, typename Keys>
void ScoreTile(const float* q, const Keys& keys, float* scores, int64_t head_dim, int64_t scores_stride) {
  Vec acc[GB][NV] = {};
  for (int64_t h = 0; h < head_dim; ++h) {
    Vec kv[NV];
    keys.Load(h, kv);
    for (int g = 0; g < GB; ++g) {
      const float qg = q[g * head_dim + h];
      for (int j = 0; j < NV; ++j) acc[g][j] += qg * kv[j];
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < NV; ++j) Store(scores + g * scores_stride + kLanes * j, acc[g][j]);
}

// Paged keys are stored by position, a row of head_dim entries each: their scores are dot
// products along the rows, kLanes rows at a time (kvjax::SumEach, simd.h).

// scores[0:kLanes] = q . (the rows at pool + offsets[0:kLanes]), each of head_dim entries.
template <typename T>
void RowScores(const float* q, const T* pool, const int32_t* offsets, float* scores, int64_t head_dim) {
  Vec acc[kLanes] = {};
  const int64_t full = head_dim / kLanes * kLanes, rest = head_dim - full;
  for (int64_t h = 0; h < full; h += kLanes) {
    const Vec qv = Load(q + h);
#pragma GCC unroll 16
    for (int i = 0; i < kLanes; ++i) acc[BitReversed(i)] += qv * LoadAs(pool + offsets[i] + h);
  }
  if (rest) {
    const Vec qv = LoadPart(q + full, rest);
#pragma GCC unroll 16
    for (int i = 0; i < kLanes; ++i) acc[BitReversed(i)] += qv * LoadPartAs(pool + offsets[i] + full, rest);
  }
  Store(scores, SumEach(acc));
}

// How a chunk's value rows are found: Row(s) is position s's row of head_dim entries, Ahead(s)
// one to prefetch (about 16 rows further down).

// Contiguous values: consecutive rows from the chunk's first position.
template <typename T>
struct ConsecutiveRows {
  const T* values;
  int64_t head_dim;
  const T* Row(int64_t s) const { return values + s * head_dim; }
  const T* Ahead(int64_t s) const { return values + s * head_dim + kValuePrefetch; }
};

// Paged values: position s's row is at pool + offsets[s] (offsets padded past the chunk).
template <typename T>
struct PagedRows {
  const T* pool;
  const int32_t* offsets;
  const T* Row(int64_t s) const { return pool + offsets[s]; }
  const T* Ahead(int64_t s) const { return pool + offsets[s + kRowsAhead]; }
};

// out[g, 0:width] = sum over s < len of probs[g, s] * rows.Row(s)[h:h + width] for GB query
// heads, width = HV vectors, the last holding only `rest` lanes if kPartial; out has row stride
// head_dim + 2.
template <int GB, int HV, bool kPartial, typename Rows>
void ValueTile(const float* probs, const Rows& rows, int64_t h, float* out, int64_t len, int64_t head_dim,
               int64_t rest, int64_t probs_stride) {
  Vec acc[GB][HV] = {};
  for (int64_t s = 0; s < len; ++s) {
    const auto* row = rows.Row(s) + h;
    const auto* ahead = rows.Ahead(s) + h;
    Vec vv[HV];
    for (int j = 0; j < HV; ++j) __builtin_prefetch(ahead + kLanes * j);
    for (int j = 0; j < HV; ++j) vv[j] = kPartial && j == HV - 1 ? LoadPartAs(row + kLanes * j, rest) : LoadAs(row + kLanes * j);
    for (int g = 0; g < GB; ++g) {
      const float p = probs[g * probs_stride + s];
      for (int j = 0; j < HV; ++j) acc[g][j] += p * vv[j];
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < HV; ++j) {
      if (kPartial && j == HV - 1) StorePart(out + g * (head_dim + 2) + kLanes * j, acc[g][j], rest);
      else Store(out + g * (head_dim + 2) + kLanes * j, acc[g][j]);
    }
}

// ValueTile over the whole head dim: up to 32 accumulators, 4 vectors of it at a time for up to 4
// query heads, 2 for more.
template <int GB, typename Rows>
void ValueBlock(const float* probs, const Rows& rows, float* out, int64_t len, int64_t head_dim, int64_t probs_stride) {
  constexpr int kHeadVectors = GB > 4 ? 2 : 4;
  for (int64_t h = 0; h < head_dim; h += kHeadVectors * kLanes) {
    const int64_t width = std::min(kHeadVectors * kLanes, head_dim - h), rest = width % kLanes;
    WithConstant<kHeadVectors>((width + kLanes - 1) / kLanes, [&](auto vectors) {
      constexpr int HV = decltype(vectors)::value;
      if (rest) ValueTile<GB, HV, true>(probs, rows, h, out + h, len, head_dim, rest, probs_stride);
      else ValueTile<GB, HV, false>(probs, rows, h, out + h, len, head_dim, rest, probs_stride);
    });
  }
}

// int4 value rows (kvjax.cache.codec.Int4) and their scales: Codes(s) position s's H / 2 bytes,
// Scales(s) its G steps then G zero points; contiguous from the chunk's first row, or paged
// through the task's offsets (in bytes, padded past the chunk).
struct Int4Rows {
  const uint8_t* codes;
  const float* scales;
  const int32_t* offsets;  // paged, else null
  int64_t row_width, scale_width;
  const uint8_t* Codes(int64_t s) const { return codes + (offsets ? offsets[s] : s * row_width); }
  const float* Scales(int64_t s) const { return scales + (offsets ? offsets[s] / row_width : s) * scale_width; }
};

// out[g, 0:H] += sum over s < len of probs[g, s] * (c[s] - z[s]) * step[s] for GB query heads,
// where each vector of kLanes bytes lies in one group (group size a multiple of 2 * kLanes), as
// sum_s w c[s] - sum_s w z[s] with w = probs[g, s] * step[s] of the vector's group: a byte vector
// holds 2 * kLanes elements, its low nibbles the even ones and its high nibbles the odd ones,
// which accumulate apart (each byte widened once for both) and are interleaved at the end. HV
// byte vectors from byte h0 of each row; out has row stride head_dim + 2.
template <int GB, int HV>
void Int4ValueTile(const float* probs, const Int4Rows& rows, int64_t h0, float* out, int64_t len, int64_t head_dim,
                   int64_t groups, int64_t probs_stride) {
  const int64_t size = head_dim / groups;
  int64_t group[HV];
  for (int j = 0; j < HV; ++j) group[j] = 2 * (h0 + kLanes * j) / size;
  Vec even[GB][HV] = {}, odd[GB][HV] = {};
  float zeros[GB][HV] = {};
  for (int64_t s = 0; s < len; ++s) {
    const uint8_t* row = rows.Codes(s) + h0;
    const float* scale = rows.Scales(s);
    __builtin_prefetch(rows.Codes(s + kRowsAhead) + h0);
    __builtin_prefetch(rows.Scales(s + kRowsAhead));
    Vec low[HV], high[HV];
    for (int j = 0; j < HV; ++j) {
      low[j] = kvjax::LoadNibbleLanes(row + kLanes * j, false);
      high[j] = kvjax::LoadNibbleLanes(row + kLanes * j, true);
    }
    for (int g = 0; g < GB; ++g) {
      const float p = probs[g * probs_stride + s];
      for (int j = 0; j < HV; ++j) {
        const float w = p * scale[group[j]];
        even[g][j] += w * low[j];
        odd[g][j] += w * high[j];
        zeros[g][j] += w * scale[groups + group[j]];
      }
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < HV; ++j) {
      float* o = out + g * (head_dim + 2) + 2 * (h0 + kLanes * j);
      for (int i = 0; i < kLanes; ++i) {
        o[2 * i] += even[g][j][i] - zeros[g][j];
        o[2 * i + 1] += odd[g][j][i] - zeros[g][j];
      }
    }
}

// A worker's buffers, reused over its tasks.
struct Scratch {
  std::vector<float> scores;     // groups rows of score_stride()
  std::vector<int32_t> offsets;  // paged: each position's row, in elements from the pool's start
  std::vector<float> scales;     // paged int8 and fp8: each position's key scale, then its value scale
  std::vector<float> rows;       // int4: decoded key rows (paged) or value rows, kValueBlock of H
  std::vector<float> block_out;  // int4: one block of value rows' outputs, laid out as a task's
  std::vector<int32_t> tile;     // int4 paged: the decoded key rows' offsets
  std::vector<float> q_sums;     // int4 contiguous: each query head's sum over each group
};

// T: the stored type (codecs.h); kPaged: page pools read through page tables.
template <typename T, bool kPaged>
struct Problem {
  static constexpr bool kScaled = Storage<T>::kScaled;
  static constexpr bool kGrouped = Storage<T>::kGrouped;
  static constexpr int64_t kPadding = std::max(kRowsAhead, kKeyRowsAhead + kLanes);  // offsets past the chunk

  const float* q;
  const T* k;
  const T* v;
  const float* k_scale;  // scaled: one per stored (position, kv head), laid out as k without H; int4: [2G] each
  const float* v_scale;
  const int32_t* page_table;  // paged: [B, M]
  const int32_t* valid;
  int64_t batch, kv_heads, groups, head_dim, max_len;  // paged: max_len = M * Z
  int64_t num_pages, page_size, table_width;  // paged: P, Z, M
  int64_t row_width, scale_groups;  // stored entries per vector (H, or H / 2 for int4); int4: G
  int64_t chunks, chunk;  // chunks per (row, kv head) pair, positions per chunk
  // Per task: for each query head, H unnormalised outputs, the running max, the sum of exponentials.
  float* partial;

  int64_t tasks() const { return batch * kv_heads * chunks; }
  int64_t partial_stride() const { return groups * (head_dim + 2); }
  // A task's scores buffer holds groups rows of this many floats: chunk rounded up to a tile.
  int64_t score_stride() const {
    constexpr int64_t tile = kScoreVectors * kLanes;
    return (chunk + tile - 1) / tile * tile;
  }
  // Paged: the pool row (of H entries, counted over all kv heads) holding position s of row b's kv head kv.
  int64_t PoolRow(int64_t b, int64_t kv, int64_t s) const {
    return (kv * num_pages + page_table[b * table_width + s / page_size]) * page_size + s % page_size;
  }
  void Prepare(Scratch& scratch) const {
    scratch.scores.resize(groups * score_stride());
    if constexpr (kPaged) scratch.offsets.resize(score_stride() + kPadding);
    if constexpr (kPaged && kScaled) scratch.scales.resize(2 * score_stride());
    if constexpr (kGrouped) {
      scratch.rows.resize(std::max(kValueBlock, kLanes) * head_dim);
      scratch.block_out.resize(partial_stride());
      scratch.tile.resize(kLanes);
      scratch.q_sums.resize(groups * scale_groups);
      for (int64_t i = 0; i < kLanes; ++i) scratch.tile[i] = static_cast<int32_t>(i * head_dim);
    }
  }
  void RunTask(int64_t task, Scratch& scratch) const;
  void Merge(float* out) const;
};

template <typename T, bool kPaged>
void Problem<T, kPaged>::RunTask(int64_t task, Scratch& scratch) const {
  const int64_t pair = task / chunks, c = task % chunks;
  const int64_t b = pair / kv_heads, kv = pair % kv_heads;
  const int64_t s0 = std::min<int64_t>(c * chunk, valid[b]);
  const int64_t len = std::min<int64_t>(chunk, valid[b] - s0);
  const int64_t stride = score_stride();
  const float* qp = q + pair * groups * head_dim;
  float* out = partial + task * partial_stride();
  float* scores = scratch.scores.data();
  if (len == 0) {  // no outputs, a zero sum and a max of -inf: the merge skips it
    std::memset(out, 0, partial_stride() * sizeof(float));
    for (int64_t g = 0; g < groups; ++g) out[g * (head_dim + 2) + head_dim] = -std::numeric_limits<float>::infinity();
    return;
  }

  // Paged: where each position's row starts; positions past len (the last tile's tail, the value
  // prefetches) repeat the last one, so that every read stays inside the row's pages.
  int32_t* offsets = scratch.offsets.data();
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
  if constexpr (kPaged) {
    for (int64_t i = 0; i < len;) {  // a page at a time
      const int64_t row = PoolRow(b, kv, s0 + i), end = std::min(len, i + page_size - (s0 + i) % page_size);
      for (int64_t first = i; i < end; ++i) offsets[i] = static_cast<int32_t>((row + i - first) * row_width);
    }
    std::fill(offsets + len, offsets + stride + kPadding, offsets[len - 1]);
    if constexpr (kScaled) {
      float* scales = scratch.scales.data();
      for (int64_t i = 0; i < len; ++i) {
        scales[i] = k_scale[offsets[i] / row_width];
        scales[stride + i] = v_scale[offsets[i] / row_width];
      }
      k_scales = scales, v_scales = scales + stride;
    }
  } else if constexpr (kScaled) {
    k_scales = k_scale + pair * max_len + s0, v_scales = v_scale + pair * max_len + s0;
  }
  const int64_t scale_width = 2 * scale_groups;  // int4: floats of scales per vector

  // Scores, a tile of positions at a time (positions past len are computed and ignored).
  if constexpr (kPaged) {  // a tile's rows, prefetched two tiles ahead, for every query head while in L1
    for (int64_t s = 0; s < len; s += kLanes) {
      for (int64_t i = 0; i < kLanes; ++i)
        for (int64_t h = 0; h < row_width; h += 64 / sizeof(T)) __builtin_prefetch(k + offsets[s + kKeyRowsAhead + i] + h);
      if constexpr (kGrouped) {  // the tile's rows decoded once for every query head
        float* rows = scratch.rows.data();
        for (int64_t i = 0; i < kLanes; ++i)
          kvjax::DecodeInt4(k + offsets[s + i], k_scale + offsets[s + i] / row_width * scale_width, head_dim,
                            scale_groups, rows + i * head_dim);
        for (int64_t g = 0; g < groups; ++g)
          RowScores(qp + g * head_dim, rows, scratch.tile.data(), scores + g * stride + s, head_dim);
      } else {
        for (int64_t g = 0; g < groups; ++g)
          RowScores(qp + g * head_dim, k, offsets + s, scores + g * stride + s, head_dim);
      }
    }
  } else {  // up to 8 query heads per pass over the chunk's keys
    const T* keys = k + pair * row_width * max_len;
    const float* key_scales = kGrouped ? k_scale + pair * scale_width * max_len : nullptr;
    float* q_sums = scratch.q_sums.data();
    if constexpr (kGrouped)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t i = 0; i < scale_groups; ++i) {
          const int64_t size = head_dim / scale_groups;
          q_sums[g * scale_groups + i] = std::accumulate(qp + g * head_dim + i * size, qp + g * head_dim + (i + 1) * size, 0.0f);
        }
    for (int64_t g = 0; g < groups; g += kScoreGroups) {
      const float* qg = qp + g * head_dim;
      float* sg = scores + g * stride;
      WithConstant<kScoreGroups>(std::min(kScoreGroups, groups - g), [&](auto block) {
        constexpr int GB = decltype(block)::value;
        // GB x NV accumulators (int4: twice, and two vectors of codes)
        constexpr int NV = (GB > 4 ? kScoreVectors / 2 : kScoreVectors) / (kGrouped ? 2 : 1);
        auto tile = [&](auto vectors, int64_t s) {  // the tile of `vectors` vectors from chunk position s
          constexpr int W = decltype(vectors)::value;
          const bool inside = s0 + s + W * kLanes <= max_len;
          if constexpr (kGrouped) {
            const float* sums = q_sums + g * scale_groups;
            if (inside)
              Int4ScoreTile<GB, W, false>(qg, sums, keys, key_scales, sg + s, head_dim, scale_groups, max_len, s0 + s, stride);
            else
              Int4ScoreTile<GB, W, true>(qg, sums, keys, key_scales, sg + s, head_dim, scale_groups, max_len, s0 + s, stride);
          } else if (inside) {
            ScoreTile<GB, W>(qg, TransposedKeys<T, W, false>{keys, max_len, s0 + s}, sg + s, head_dim, stride);
          } else {
            ScoreTile<GB, W>(qg, TransposedKeys<T, W, true>{keys, max_len, s0 + s}, sg + s, head_dim, stride);
          }
        };
        for (int64_t s = 0; s < len; s += NV * kLanes) {
          if (len - s > (NV - 1) * kLanes) tile(std::integral_constant<int, NV>{}, s);
          else for (int64_t t = s; t < len; t += kLanes) tile(std::integral_constant<int, 1>{}, t);
        }
      });
    }
  }

  // Softmax numerators in place, with each query head's max and sum kept for the merge. int8, fp8:
  // the scores take their keys' scales first, and the numerators their values' scales after the
  // sum, so that the value pass adds p * v_scale * v_int8.
  const int64_t full = len / kLanes * kLanes;
  for (int64_t g = 0; g < groups; ++g) {
    float* sg = scores + g * stride;
    if constexpr (kScaled)
      for (int64_t s = 0; s < len; ++s) sg[s] *= k_scales[s] * Storage<T>::kUnit;
    float m = -std::numeric_limits<float>::infinity();
    Vec mv = Vec{} + m;
    for (int64_t s = 0; s < full; s += kLanes) { const Vec x = Load(sg + s); mv = x > mv ? x : mv; }
    m = Max(mv);
    for (int64_t s = full; s < len; ++s) m = std::max(m, sg[s]);
    Vec sum = {};
    for (int64_t s = 0; s < full; s += kLanes) { const Vec e = Exp(Load(sg + s) - m); Store(sg + s, e); sum += e; }
    float l = Sum(sum);
    for (int64_t s = full; s < len; ++s) l += sg[s] = std::exp(sg[s] - m);
    out[g * (head_dim + 2) + head_dim] = m;
    out[g * (head_dim + 2) + head_dim + 1] = l;
    if constexpr (kScaled)
      for (int64_t s = 0; s < len; ++s) sg[s] *= v_scales[s] * Storage<T>::kUnit;
  }

  auto values = [&](auto rows) {
    for (int64_t g = 0; g < groups; g += kValueGroups)
      WithConstant<kValueGroups>(std::min(kValueGroups, groups - g), [&](auto block) {
        ValueBlock<decltype(block)::value>(scores + g * stride, rows, out + g * (head_dim + 2), len, head_dim, stride);
      });
  };
  if constexpr (kGrouped) {
    for (int64_t g = 0; g < groups; ++g) std::fill(out + g * (head_dim + 2), out + g * (head_dim + 2) + head_dim, 0.0f);
  }
  if constexpr (kGrouped) {
    if ((head_dim / scale_groups) % (2 * kLanes) == 0) {  // whole byte vectors per group: read in place
      const Int4Rows rows = kPaged ? Int4Rows{v, v_scale, offsets, row_width, scale_width}
                                   : Int4Rows{v + (pair * max_len + s0) * row_width, v_scale + (pair * max_len + s0) * scale_width,
                                              nullptr, row_width, scale_width};
      for (int64_t g = 0; g < groups; g += kValueGroups)
        WithConstant<kValueGroups>(std::min(kValueGroups, groups - g), [&](auto block) {
          constexpr int GB = decltype(block)::value, HV = GB > 4 ? 1 : 2;
          for (int64_t h = 0; h < row_width; h += HV * kLanes) {
            if (row_width - h >= HV * kLanes)
              Int4ValueTile<GB, HV>(scores + g * stride, rows, h, out + g * (head_dim + 2), len, head_dim, scale_groups, stride);
            else
              Int4ValueTile<GB, 1>(scores + g * stride, rows, h, out + g * (head_dim + 2), len, head_dim, scale_groups, stride);
          }
        });
      return;
    }
  }
  if constexpr (kGrouped) {  // other group sizes: blocks of value rows decoded, their outputs added up
    float* rows = scratch.rows.data();
    float* block_out = scratch.block_out.data();
    for (int64_t first = 0; first < len; first += kValueBlock) {
      const int64_t n = std::min(kValueBlock, len - first);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = kPaged ? offsets[first + i] / row_width : pair * max_len + s0 + first + i;
        kvjax::DecodeInt4(v + row * row_width, v_scale + row * scale_width, head_dim, scale_groups, rows + i * head_dim);
      }
      for (int64_t g = 0; g < groups; g += kValueGroups)
        WithConstant<kValueGroups>(std::min(kValueGroups, groups - g), [&](auto block) {
          ValueBlock<decltype(block)::value>(scores + g * stride + first, ConsecutiveRows<float>{rows, head_dim},
                                             block_out + g * (head_dim + 2), n, head_dim, stride);
        });
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t h = 0; h < head_dim; ++h) out[g * (head_dim + 2) + h] += block_out[g * (head_dim + 2) + h];
    }
  } else if constexpr (kPaged) {
    values(PagedRows<T>{v, offsets});
  } else {
    values(ConsecutiveRows<T>{v + (pair * max_len + s0) * head_dim, head_dim});
  }
}

// out[pair, g] = the chunks' outputs rescaled to their common max, over their common sum.
template <typename T, bool kPaged>
void Problem<T, kPaged>::Merge(float* out) const {
  const int64_t hd = head_dim + 2;
  for (int64_t pair = 0; pair < batch * kv_heads; ++pair)
    for (int64_t g = 0; g < groups; ++g) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c) m = std::max(m, partial[((pair * chunks + c) * groups + g) * hd + head_dim]);
      float l = 0;
      float* o = out + (pair * groups + g) * head_dim;
      std::fill(o, o + head_dim, 0.0f);
      for (int64_t c = 0; c < chunks; ++c) {
        const float* p = partial + ((pair * chunks + c) * groups + g) * hd;
        if (p[head_dim + 1] == 0) continue;  // an empty chunk
        const float scale = std::exp(p[head_dim] - m);
        l += scale * p[head_dim + 1];
        for (int64_t h = 0; h < head_dim; ++h) o[h] += scale * p[h];
      }
      if (l > 0)
        for (int64_t h = 0; h < head_dim; ++h) o[h] /= l;
    }
}

// Checks the lengths (and a paged problem's page-table entries for the valid positions), picks
// the chunks and runs the tasks over the thread pool, then merges them into out [B, K, G, H].
template <typename T, bool kPaged>
ffi::Error Run(ffi::ThreadPool& pool, Problem<T, kPaged> problem, float* out, const char* name) {
  const int64_t batch = problem.batch, max_len = problem.max_len;
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = problem.valid[b];
    if (length < 0 || length > max_len)
      return ffi::Error::InvalidArgument(std::string(name) + ": valid length outside [0, S]");
    longest = std::max(longest, length);
    if constexpr (kPaged)
      for (int64_t j = 0; j * problem.page_size < length; ++j) {
        const int32_t page = problem.page_table[b * problem.table_width + j];
        if (page < 0 || page >= problem.num_pages)
          return ffi::Error::InvalidArgument(std::string(name) + ": a page-table entry for valid positions is outside the pool");
      }
  }
  if (batch * problem.kv_heads * problem.groups == 0) return ffi::Error::Success();

  // Enough tasks to share over the threads, chunks of kMinChunk to kMaxChunk positions where
  // the lengths allow.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t pairs = batch * problem.kv_heads;
  const int64_t wanted = std::max<int64_t>(1, (kTasksPerThread * threads + pairs - 1) / pairs);
  problem.chunks = std::max({int64_t{1}, std::min(wanted, longest / kMinChunk), (longest + kMaxChunk - 1) / kMaxChunk});
  problem.chunk = std::max<int64_t>(1, (longest + problem.chunks - 1) / problem.chunks);

  std::unique_ptr<float[]> partial(new float[pairs * problem.chunks * problem.partial_stride()]);  // set by each task
  problem.partial = partial.get();
  const int64_t workers = std::min(threads, problem.tasks());
  std::vector<Scratch> scratch(workers);  // per worker, allocated on its first task
  kvjax::ParallelFor(pool, problem.tasks(), workers, [&](int64_t task, int64_t worker) {
    if (scratch[worker].scores.empty()) problem.Prepare(scratch[worker]);
    problem.RunTask(task, scratch[worker]);
  });
  problem.Merge(out);
  return ffi::Error::Success();
}

// Named types: the registration macros below split their arguments at commas.
using Array4 = ffi::Buffer<ffi::F32, 4>;
using Scales3 = ffi::Buffer<ffi::F32, 3>;
using Scales4 = ffi::Buffer<ffi::F32, 4>;
using Result4 = ffi::ResultBuffer<ffi::F32, 4>;
using Lengths = ffi::Buffer<ffi::S32, 1>;
using Table = ffi::Buffer<ffi::S32, 2>;

// The XLA element type each stored type is bound as: bfloat16 and e4m3 come as their bits
// (kvjax/cache/codec.py stores them so), int4 as its bytes.
template <typename T>
constexpr ffi::DataType kElement = std::is_same_v<T, float>      ? ffi::F32
                                   : std::is_same_v<T, int8_t>   ? ffi::S8
                                   : std::is_same_v<T, BFloat16> ? ffi::U16
                                   : std::is_same_v<T, Float16>  ? ffi::F16
                                                                 : ffi::U8;

// A target's scales: none, one per vector (the data's dimensions without H: 3 axes), or int4's
// groups (4 axes: 2G floats where the data has H / 2 entries; transposed keys' on axis 2).
struct Scales {
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t groups = 0;
  bool fit = true;
};

template <typename T>
Scales ScalesOf(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, bool transposed) {
  const auto kd = k.dimensions(), vd = v.dimensions(), ksd = k_scale.dimensions(), vsd = v_scale.dimensions();
  Scales s{reinterpret_cast<const float*>(k_scale.untyped_data()), reinterpret_cast<const float*>(v_scale.untyped_data())};
  s.fit = k_scale.element_type() == ffi::F32 && v_scale.element_type() == ffi::F32 && kd.size() == 4 && vd.size() == 4;
  if (!s.fit) return s;
  if constexpr (Storage<T>::kGrouped) {
    const int64_t key_axis = transposed ? 2 : 3;  // the keys' width axis
    s.groups = vsd.size() == 4 ? vsd[3] / 2 : 0;
    auto like = [](auto dims, int64_t axis, int64_t width) {
      std::vector<int64_t> want(dims.begin(), dims.end());
      want[axis] = width;
      return want;
    };
    const auto k_want = like(kd, key_axis, 2 * s.groups), v_want = like(vd, 3, 2 * s.groups);
    s.fit = s.groups > 0 && vsd[3] % 2 == 0 && ksd.size() == 4 && vsd.size() == 4 &&
            std::equal(k_want.begin(), k_want.end(), ksd.begin()) && std::equal(v_want.begin(), v_want.end(), vsd.begin()) &&
            vd[3] % s.groups == 0 && (2 * vd[3] / s.groups) % 2 == 0;
  } else {
    const int64_t seq_axis = transposed ? 3 : 2;
    s.fit = Is(ksd, {kd[0], kd[1], kd[seq_axis]}) && Is(vsd, {vd[0], vd[1], vd[2]});
  }
  return s;
}

// Contiguous caches: q [B, K, G, H], k [B, K, H', S], v [B, K, S, H'] (module comment).
template <typename T>
ffi::Error Contiguous(ffi::ThreadPool& pool, Array4& q, ffi::AnyBuffer& k, ffi::AnyBuffer& v, Scales scales,
                      Lengths& valid, Result4& out, const char* name) {
  const auto qd = q.dimensions(), vd = v.dimensions();
  const int64_t batch = qd[0], kv_heads = qd[1], groups = qd[2], head_dim = qd[3], max_len = vd.size() == 4 ? vd[2] : 0;
  const int64_t width = head_dim / Storage<T>::kPerEntry;
  if (k.element_type() != kElement<T> || v.element_type() != kElement<T> ||
      head_dim != width * Storage<T>::kPerEntry || !Is(k.dimensions(), {batch, kv_heads, width, max_len}) ||
      !Is(vd, {batch, kv_heads, max_len, width}) || !Is(valid.dimensions(), {batch}) || !scales.fit)
    return ffi::Error::InvalidArgument(std::string(name) + " expects q [B, K, G, H], k [B, K, H', S], v [B, K, S, H'] "
                                       "of its codec, its scales and valid [B] (kvjax/kernels/csrc/decode_attention.cc)");
  Problem<T, false> problem{q.typed_data(), reinterpret_cast<const T*>(k.untyped_data()),
                            reinterpret_cast<const T*>(v.untyped_data()), scales.k, scales.v, nullptr,
                            valid.typed_data(), batch, kv_heads, groups, head_dim, max_len, 0, 0, 0, width,
                            scales.groups};
  return Run(pool, problem, out->typed_data(), name);
}

// Paged caches: q [B, K, G, H], pools [K, P, Z, H'], page_table [B, M].
template <typename T>
ffi::Error Paged(ffi::ThreadPool& pool, Array4& q, ffi::AnyBuffer& k, ffi::AnyBuffer& v, Scales scales,
                 Table& page_table, Lengths& valid, Result4& out, const char* name) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = page_table.dimensions();
  const int64_t batch = qd[0], kv_heads = qd[1], groups = qd[2], head_dim = qd[3];
  const int64_t num_pages = kd.size() == 4 ? kd[1] : 0, page_size = kd.size() == 4 ? kd[2] : 0, table_width = td[1];
  const int64_t width = head_dim / Storage<T>::kPerEntry;
  if (k.element_type() != kElement<T> || v.element_type() != kElement<T> ||
      head_dim != width * Storage<T>::kPerEntry || !Is(kd, {kv_heads, num_pages, page_size, width}) ||
      !Is(v.dimensions(), {kv_heads, num_pages, page_size, width}) || td[0] != batch ||
      !Is(valid.dimensions(), {batch}) || !scales.fit)
    return ffi::Error::InvalidArgument(std::string(name) + " expects q [B, K, G, H], k and v [K, P, Z, H'] of its "
                                       "codec, its scales, page_table [B, M] and valid [B] "
                                       "(kvjax/kernels/csrc/decode_attention.cc)");
  if (kv_heads * num_pages * page_size * head_dim >= (int64_t{1} << 31) - 4)
    return ffi::Error::InvalidArgument(std::string(name) + ": pools of 2^31 entries or more are addressed by XLA");
  Problem<T, true> problem{q.typed_data(), reinterpret_cast<const T*>(k.untyped_data()),
                           reinterpret_cast<const T*>(v.untyped_data()), scales.k, scales.v,
                           page_table.typed_data(), valid.typed_data(), batch, kv_heads, groups, head_dim,
                           table_width * page_size, num_pages, page_size, table_width, width, scales.groups};
  return Run(pool, problem, out->typed_data(), name);
}

// One handler per stored type and layout: unscaled, or with k_scale and v_scale.
template <typename T>
ffi::Error ContiguousPlain(ffi::ThreadPool pool, Array4 q, ffi::AnyBuffer k, ffi::AnyBuffer v, Lengths valid,
                           Result4 out) {
  return Contiguous<T>(pool, q, k, v, Scales{}, valid, out, "kvjax_decode_attention");
}

template <typename T>
ffi::Error ContiguousScaled(ffi::ThreadPool pool, Array4 q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, Lengths valid, Result4 out) {
  return Contiguous<T>(pool, q, k, v, ScalesOf<T>(k, v, k_scale, v_scale, true), valid, out,
                       "kvjax_decode_attention (scaled)");
}

template <typename T>
ffi::Error PagedPlain(ffi::ThreadPool pool, Array4 q, ffi::AnyBuffer k, ffi::AnyBuffer v, Table page_table,
                      Lengths valid, Result4 out) {
  return Paged<T>(pool, q, k, v, Scales{}, page_table, valid, out, "kvjax_paged_attention");
}

template <typename T>
ffi::Error PagedScaled(ffi::ThreadPool pool, Array4 q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer k_scale,
                       ffi::AnyBuffer v_scale, Table page_table, Lengths valid, Result4 out) {
  return Paged<T>(pool, q, k, v, ScalesOf<T>(k, v, k_scale, v_scale, false), page_table, valid, out,
                  "kvjax_paged_attention (scaled)");
}

}  // namespace

#define KVJAX_CONTIGUOUS_PLAIN(symbol, type)                                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, ContiguousPlain<type>,                                            \
                                ffi::Ffi::Bind()                                                          \
                                    .Ctx<ffi::ThreadPool>()                                               \
                                    .Arg<Array4>()                                                        \
                                    .Arg<ffi::AnyBuffer>()                                                \
                                    .Arg<ffi::AnyBuffer>()                                                \
                                    .Arg<Lengths>()                                                       \
                                    .Ret<Array4>())
#define KVJAX_CONTIGUOUS_SCALED(symbol, type)                                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, ContiguousScaled<type>,                                           \
                                ffi::Ffi::Bind()                                                          \
                                    .Ctx<ffi::ThreadPool>()                                               \
                                    .Arg<Array4>()                                                        \
                                    .Arg<ffi::AnyBuffer>()                                                \
                                    .Arg<ffi::AnyBuffer>()                                                \
                                    .Arg<ffi::AnyBuffer>()                                                \
                                    .Arg<ffi::AnyBuffer>()                                                \
                                    .Arg<Lengths>()                                                       \
                                    .Ret<Array4>())
#define KVJAX_PAGED_PLAIN(symbol, type)                                                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, PagedPlain<type>,                                                 \
                                ffi::Ffi::Bind()                                                          \
                                    .Ctx<ffi::ThreadPool>()                                               \
                                    .Arg<Array4>()                                                        \
                                    .Arg<ffi::AnyBuffer>()                                                \
                                    .Arg<ffi::AnyBuffer>()                                                \
                                    .Arg<Table>()                                                         \
                                    .Arg<Lengths>()                                                       \
                                    .Ret<Array4>())
#define KVJAX_PAGED_SCALED(symbol, type)                                                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, PagedScaled<type>,                                                \
                                ffi::Ffi::Bind()                                                          \
                                    .Ctx<ffi::ThreadPool>()                                               \
                                    .Arg<Array4>()                                                        \
                                    .Arg<ffi::AnyBuffer>()                                                \
                                    .Arg<ffi::AnyBuffer>()                                                \
                                    .Arg<ffi::AnyBuffer>()                                                \
                                    .Arg<ffi::AnyBuffer>()                                                \
                                    .Arg<Table>()                                                         \
                                    .Arg<Lengths>()                                                       \
                                    .Ret<Array4>())

KVJAX_CONTIGUOUS_PLAIN(KvjaxDecodeAttention, float);
KVJAX_CONTIGUOUS_PLAIN(KvjaxDecodeAttentionBf16, BFloat16);
KVJAX_CONTIGUOUS_PLAIN(KvjaxDecodeAttentionF16, Float16);
KVJAX_CONTIGUOUS_SCALED(KvjaxDecodeAttentionInt8, int8_t);
KVJAX_CONTIGUOUS_SCALED(KvjaxDecodeAttentionFp8, Float8E4M3);
KVJAX_CONTIGUOUS_SCALED(KvjaxDecodeAttentionInt4, uint8_t);
KVJAX_PAGED_PLAIN(KvjaxPagedAttention, float);
KVJAX_PAGED_PLAIN(KvjaxPagedAttentionBf16, BFloat16);
KVJAX_PAGED_PLAIN(KvjaxPagedAttentionF16, Float16);
KVJAX_PAGED_SCALED(KvjaxPagedAttentionInt8, int8_t);
KVJAX_PAGED_SCALED(KvjaxPagedAttentionFp8, Float8E4M3);
KVJAX_PAGED_SCALED(KvjaxPagedAttentionInt4, uint8_t);
