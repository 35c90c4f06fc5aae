// kvjax_decode_attention: one query token per sequence attends to its cached keys and values,
// in float32 on the CPU.
//
// An XLA FFI handler. Inputs, in the kv-head-major layout of kvjax's cache:
//   q      [B, K, G, H]  the step's queries, grouped by kv head and already scaled,
//   k      [B, K, H, S]  cached keys, transposed,
//   v      [B, K, S, H]  cached values,
//   valid  int32 [B]     how many cached positions each row attends to (its length + 1),
// and the output [B, K, G, H]. Each (row, kv head) pair is cut into chunks of positions; a task
// reads a chunk's keys once for up to 8 query heads (scores as [G, H] x [H, chunk] with
// positions in vector lanes), takes the softmax in a per-thread buffer that stays in cache, and
// reads the chunk's values once; the chunks of a pair are merged afterwards (the split softmax
// of flash decoding). Only positions below valid[b] are read: XLA's masked attention reads the
// whole preallocated cache.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using kvjax::IVec;
using kvjax::kLanes;
using kvjax::Load;
using kvjax::LoadPart;
using kvjax::Store;
using kvjax::StorePart;
using kvjax::Vec;

constexpr int64_t kScoreVectors = 4;  // positions per score tile, in vectors
constexpr int64_t kScoreGroups = 8;   // query heads per register tile of scores
constexpr int64_t kValueGroups = 8;   // query heads per register tile of outputs
constexpr int64_t kMinChunk = 256;    // positions: shorter chunks read their key rows in shorter runs
constexpr int64_t kMaxChunk = 2048;   // positions: a chunk's scores (G x chunk floats) stay in L2
constexpr int64_t kTasksPerThread = 4;
// Software prefetch distances, in floats. The hardware prefetcher alone leaves the loops waiting
// on memory when many query heads share each cached row (the value loop's single stream, and the
// key tile's head_dim rows of stride max_len). A prefetch past a buffer's end never faults.
constexpr int64_t kKeyPrefetch = 64;      // 256 B along each key row (1-2 score tiles at 16 lanes)
constexpr int64_t kValuePrefetch = 1024;  // 4 KB down the values

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

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* valid;
  int64_t batch, kv_heads, groups, head_dim, max_len;
  int64_t chunks, chunk;  // chunks per (row, kv head) pair, positions per chunk
  // Per task: for each query head, the running max, the sum of exponentials, then H
  // unnormalised outputs.
  float* partial;

  int64_t tasks() const { return batch * kv_heads * chunks; }
  int64_t partial_stride() const { return groups * (head_dim + 2); }
  // A task's scores buffer holds groups rows of this many floats: chunk rounded up to a tile.
  int64_t score_stride() const {
    constexpr int64_t tile = kScoreVectors * kLanes;
    return (chunk + tile - 1) / tile * tile;
  }
  void RunTask(int64_t task, float* scores) const;
  void Merge(float* out) const;
};

// scores[g, s - s0 + 0:NV*kLanes] = q[g] . keys[:, s + 0:NV*kLanes] for GB query heads; keys has
// row stride max_len. kEdge: the tile reaches past max_len, whose positions read as zero.
// (Whether a load is partial is decided at compile time: a choice made in the loop keeps the
// accumulators out of registers.)
template <int GB, int NV, bool kEdge>
void ScoreTile(const float* q, const float* keys, float* scores, int64_t head_dim, int64_t max_len,
               int64_t s, int64_t s0, int64_t scores_stride) {
  Vec acc[GB][NV] = {};
  for (int64_t h = 0; h < head_dim; ++h) {
    const float* row = keys + h * max_len + s;
    for (int j = 0; j < NV; ++j) __builtin_prefetch(row + kLanes * j + kKeyPrefetch);
    Vec kv[NV];
    for (int j = 0; j < NV; ++j) {
      const int64_t left = max_len - s - kLanes * j;
      kv[j] = !kEdge || left >= kLanes ? Load(row + kLanes * j) : left > 0 ? LoadPart(row + kLanes * j, left) : Vec{};
    }
    for (int g = 0; g < GB; ++g) {
      const float qg = q[g * head_dim + h];
      for (int j = 0; j < NV; ++j) acc[g][j] += qg * kv[j];
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < NV; ++j) Store(scores + g * scores_stride + s - s0 + kLanes * j, acc[g][j]);
}

// out[g, 0:width] = sum over s < len of probs[g, s] * values[s, 0:width] for GB query heads,
// width = HV vectors, the last holding only `rest` lanes if kPartial; values has row stride
// head_dim and out has row stride head_dim + 2.
template <int GB, int HV, bool kPartial>
void ValueTile(const float* probs, const float* values, float* out, int64_t len, int64_t head_dim,
               int64_t rest, int64_t probs_stride) {
  Vec acc[GB][HV] = {};
  for (int64_t s = 0; s < len; ++s) {
    const float* row = values + s * head_dim;
    Vec vv[HV];
    for (int j = 0; j < HV; ++j) __builtin_prefetch(row + kLanes * j + kValuePrefetch);
    for (int j = 0; j < HV; ++j) vv[j] = kPartial && j == HV - 1 ? LoadPart(row + kLanes * j, rest) : Load(row + kLanes * j);
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

// fn(std::integral_constant<int, n>) for 1 <= n <= kMax: a run-time count as a template argument.
template <int kMax, typename Fn>
inline void WithConstant(int64_t n, Fn fn) {
  if constexpr (kMax > 1)
    if (n < kMax) return WithConstant<kMax - 1>(n, fn);
  fn(std::integral_constant<int, kMax>{});
}

// ValueTile over the whole head dim: up to 32 accumulators, 4 vectors of it at a time for up to 4
// query heads, 2 for more.
template <int GB>
void ValueBlock(const float* probs, const float* values, float* out, int64_t len, int64_t head_dim,
                int64_t probs_stride) {
  constexpr int kHeadVectors = GB > 4 ? 2 : 4;
  for (int64_t h = 0; h < head_dim; h += kHeadVectors * kLanes) {
    const int64_t width = std::min(kHeadVectors * kLanes, head_dim - h), rest = width % kLanes;
    WithConstant<kHeadVectors>((width + kLanes - 1) / kLanes, [&](auto vectors) {
      constexpr int HV = decltype(vectors)::value;
      if (rest) ValueTile<GB, HV, true>(probs, values + h, out + h, len, head_dim, rest, probs_stride);
      else ValueTile<GB, HV, false>(probs, values + h, out + h, len, head_dim, rest, probs_stride);
    });
  }
}

void Problem::RunTask(int64_t task, float* scores) const {
  const int64_t pair = task / chunks, c = task % chunks;
  const int64_t b = pair / kv_heads;
  const int64_t s0 = std::min<int64_t>(c * chunk, valid[b]);
  const int64_t len = std::min<int64_t>(chunk, valid[b] - s0);
  const int64_t stride = score_stride();
  const float* qp = q + pair * groups * head_dim;
  const float* keys = k + pair * head_dim * max_len;
  float* out = partial + task * partial_stride();
  if (len == 0) {  // no outputs, a zero sum and a max of -inf: the merge skips it
    std::memset(out, 0, partial_stride() * sizeof(float));
    for (int64_t g = 0; g < groups; ++g) out[g * (head_dim + 2) + head_dim] = -std::numeric_limits<float>::infinity();
    return;
  }

  // Scores, a tile of positions at a time (positions past len are computed and ignored), for up
  // to 8 query heads per pass over the chunk's keys.
  for (int64_t g = 0; g < groups; g += kScoreGroups) {
    const float* qg = qp + g * head_dim;
    float* sg = scores + g * stride;
    WithConstant<kScoreGroups>(std::min(kScoreGroups, groups - g), [&](auto block) {
      constexpr int GB = decltype(block)::value;
      constexpr int NV = GB > 4 ? kScoreVectors / 2 : kScoreVectors;  // GB x NV accumulators
      for (int64_t s = 0; s < len; s += NV * kLanes) {
        if (len - s > (NV - 1) * kLanes) {
          if (s0 + s + NV * kLanes <= max_len) ScoreTile<GB, NV, false>(qg, keys, sg, head_dim, max_len, s0 + s, s0, stride);
          else ScoreTile<GB, NV, true>(qg, keys, sg, head_dim, max_len, s0 + s, s0, stride);
        } else {
          for (int64_t t = s; t < len; t += kLanes) ScoreTile<GB, 1, true>(qg, keys, sg, head_dim, max_len, s0 + t, s0, stride);
        }
      }
    });
  }

  // Softmax numerators in place, with each query head's max and sum kept for the merge.
  const int64_t full = len / kLanes * kLanes;
  for (int64_t g = 0; g < groups; ++g) {
    float* sg = scores + g * stride;
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
  }

  const float* values = v + (pair * max_len + s0) * head_dim;
  for (int64_t g = 0; g < groups; g += kValueGroups)
    WithConstant<kValueGroups>(std::min(kValueGroups, groups - g), [&](auto block) {
      ValueBlock<decltype(block)::value>(scores + g * stride, values, out + g * (head_dim + 2), len, head_dim, stride);
    });
}

// out[pair, g] = the chunks' outputs rescaled to their common max, over their common sum.
void Problem::Merge(float* out) const {
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

// Named types: the registration macro below splits its arguments at commas.
using Array4 = ffi::Buffer<ffi::F32, 4>;
using Result4 = ffi::ResultBuffer<ffi::F32, 4>;
using Lengths = ffi::Buffer<ffi::S32, 1>;

ffi::Error DecodeAttention(ffi::ThreadPool pool, Array4 q, Array4 k, Array4 v, Lengths valid, Result4 out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const int64_t batch = qd[0], kv_heads = qd[1], groups = qd[2], head_dim = qd[3], max_len = vd[2];
  if (kd[0] != batch || kd[1] != kv_heads || kd[2] != head_dim || kd[3] != max_len ||
      vd[0] != batch || vd[1] != kv_heads || vd[3] != head_dim || valid.dimensions()[0] != batch)
    return ffi::Error::InvalidArgument(
        "kvjax_decode_attention expects q [B, K, G, H], k [B, K, H, S], v [B, K, S, H], valid [B]");
  const int32_t* lengths = valid.typed_data();
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) {
    if (lengths[b] < 0 || lengths[b] > max_len)
      return ffi::Error::InvalidArgument("kvjax_decode_attention: valid length outside [0, S]");
    longest = std::max<int64_t>(longest, lengths[b]);
  }
  if (batch * kv_heads * groups == 0) return ffi::Error::Success();

  // Enough tasks to share over the threads, chunks of kMinChunk to kMaxChunk positions where
  // the lengths allow.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t pairs = batch * kv_heads;
  const int64_t wanted = std::max<int64_t>(1, (kTasksPerThread * threads + pairs - 1) / pairs);
  const int64_t chunks = std::max({int64_t{1}, std::min(wanted, longest / kMinChunk),
                                   (longest + kMaxChunk - 1) / kMaxChunk});
  const int64_t chunk = std::max<int64_t>(1, (longest + chunks - 1) / chunks);

  std::unique_ptr<float[]> partial(new float[pairs * chunks * groups * (head_dim + 2)]);  // set by each task
  const Problem problem{q.typed_data(), k.typed_data(), v.typed_data(), lengths, batch, kv_heads, groups,
                        head_dim, max_len, chunks, chunk, partial.get()};
  const int64_t workers = std::min(threads, problem.tasks());
  std::vector<std::vector<float>> scores(workers);  // per worker, allocated on its first task
  kvjax::ParallelFor(pool, problem.tasks(), workers, [&](int64_t task, int64_t worker) {
    if (scores[worker].empty()) scores[worker].resize(groups * problem.score_stride());
    problem.RunTask(task, scores[worker].data());
  });
  problem.Merge(out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Array4>()
                                  .Arg<Array4>()
                                  .Arg<Array4>()
                                  .Arg<Lengths>()
                                  .Ret<Array4>());
