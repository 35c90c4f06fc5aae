// kvjax_small_matmul: y[M, N] = (x[M, K] @ w[K, N]) * scale[N] for small M (decode-step rows),
// x and y float32, w stored in float32, bfloat16 or int8 and widened to float32 in registers
// (with a stored format x is first rounded to bfloat16, as kvjax's XLA products of those do);
// scale (one per output column, the int8 format's) may be empty. With `transposed`, w is stored
// [N, K] (a tied embedding table read as the logits projection) and y = x @ w^T.
//
// An XLA FFI handler for the CPU. At decode batch sizes the weights are read once per step and
// the product is bound by how fast they stream from memory; XLA's CPU dot runs these shapes
// far below the machine's bandwidth (figures in docs/results.md). This kernel reads w in
// its row-major [K, N] layout and in order: each thread takes a band of consecutive rows of w
// (the bands' partial products are summed at the end, in band order) and walks it kPanel rows
// at a time across a chunk of columns, adding each row of x times the panel into y's chunk,
// which stays in L1. Which rows each sum holds and the order of the sums are fixed by the
// shapes, never by which thread ran first: a product gives the same bits however busy the
// machine is (greedy decoding repeats itself).
// Whole rows read in order let the hardware prefetchers stream w; column tiles, a few hundred
// bytes of each row at a time, give them only short runs.
// Several rows of x (2 to 16, without bfloat16 pairs) are arithmetic as much as reading: there the
// threads take spans of columns instead, over all of w's rows, each span's sums held in registers
// (Tile), so each y value is one sum in the order of k and needs no partial sums.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#include "bf16_pairs.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using kvjax::kLanes;
using kvjax::Vec;

constexpr int64_t kPanel = 8;               // rows of w per pass over a column chunk
constexpr int64_t kChunkBytes = 32 << 10;   // of y per column chunk, to stay in L1
constexpr int64_t kMinBytesPerThread = 64 << 10;
constexpr int64_t kBandsPerThread = 4;
constexpr int64_t kPartialBytes = 1 << 20;  // at most, for the bands' own sums (unless one per thread)
// Several rows of x go by register tiles (Tile): kTileRows rows of x by kTileVectors vectors of
// columns, within the 16 vector registers of AVX2 or the 32 of AVX-512; kTileDepth rows of w per
// pass, whose tile columns stay in L1 while each group of rows of x passes over them.
constexpr int kTileRows = 4;
constexpr int kTileVectors = kLanes == 16 ? 4 : 2;
constexpr int64_t kTileDepth = 64;

// y[:, c:c+width] = (or += when add) x[:, k:k+P] @ w[k:k+P, c:c+width] for width = kLanes, or
// the first `width` < kLanes columns when Partial. x has row stride k_dim; w and y have n. With
// `prefetch`, the same columns of the next P rows are fetched into L2 meanwhile: the hardware
// prefetchers alone do not keep 8 row streams at the memory's rate.
template <int P, bool Partial, typename W>
inline void Column(const float* x, const W* w, float* y, int64_t m, int64_t k_dim, int64_t n,
                   int64_t k, int64_t c, int64_t width, bool add, bool prefetch) {
  Vec wv[P];
  for (int i = 0; i < P; ++i) wv[i] = Partial ? kvjax::LoadPartAs(w + (k + i) * n + c, width) : kvjax::LoadAs(w + (k + i) * n + c);
  if (prefetch)
    for (int i = 0; i < P; ++i) __builtin_prefetch(w + (k + P + i) * n + c, 0, 2);
  for (int64_t r = 0; r < m; ++r) {
    Vec acc = add ? (Partial ? kvjax::LoadPart(y + r * n + c, width) : kvjax::Load(y + r * n + c)) : Vec{};
    const float* xr = x + r * k_dim + k;
    for (int i = 0; i < P; ++i) acc += xr[i] * wv[i];
    if (Partial) kvjax::StorePart(y + r * n + c, acc, width);
    else kvjax::Store(y + r * n + c, acc);
  }
}

// Rows k:k+P of w across columns c0:c1.
template <int P, typename W>
void Panel(const float* x, const W* w, float* y, int64_t m, int64_t k_dim, int64_t n, int64_t k,
           int64_t c0, int64_t c1, bool add, bool prefetch) {
  int64_t c = c0;
  for (; c + kLanes <= c1; c += kLanes) Column<P, false>(x, w, y, m, k_dim, n, k, c, kLanes, add, prefetch);
  if (c < c1) Column<P, true>(x, w, y, m, k_dim, n, k, c, c1 - c, add, prefetch);
}

// Several rows of x: y's tile of R rows by V vectors of columns stays in registers while the
// rows k0:k1 of w pass, each vector of w widened once for the R rows and each value of x
// broadcast once for the V vectors (R * V sums, V loads and R broadcasts per R * V FMAs; Panel
// instead loads and stores y's vector for every row of x at every 8 rows of w, which at 8 rows of x
// made it bound by those loads, not by w). Each sum still adds x[r, k] * w[k, c] in the order of
// k, as Panel's does: the bits do not depend on the tiling. With Partial, one vector of the
// first `width` < kLanes columns.
template <int R, int V, bool Partial, typename W>
inline void Tile(const float* x, const W* w, float* y, int64_t k_dim, int64_t n, int64_t r0, int64_t k0, int64_t k1,
                 int64_t c, int64_t width, bool add, bool prefetch) {
  Vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      float* out = y + (r0 + r) * n + c + v * kLanes;
      acc[r][v] = !add ? Vec{} : Partial ? kvjax::LoadPart(out, width) : kvjax::Load(out);
    }
  const float* xr = x + r0 * k_dim;
  for (int64_t k = k0; k < k1; ++k) {
    const W* row = w + k * n + c;
    Vec wv[V];
    for (int v = 0; v < V; ++v) wv[v] = Partial ? kvjax::LoadPartAs(row, width) : kvjax::LoadAs(row + v * kLanes);
    // The same columns 4 tiles on: the rows of a block are many short runs, which the hardware
    // prefetchers do not follow at the memory's rate on their own.
    if (prefetch) __builtin_prefetch(row + 4 * V * kLanes, 0, 2);
    for (int r = 0; r < R; ++r) {
      const float xv = xr[r * k_dim + k];
      for (int v = 0; v < V; ++v) acc[r][v] += xv * wv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      float* out = y + (r0 + r) * n + c + v * kLanes;
      if (Partial) kvjax::StorePart(out, acc[r][v], width);
      else kvjax::Store(out, acc[r][v]);
    }
}

// Every row of x over the tiles of one column span (V vectors wide, or one partial vector).
template <int V, bool Partial, typename W>
inline void TileRows(const float* x, const W* w, float* y, int64_t m, int64_t k_dim, int64_t n, int64_t k0,
                     int64_t k1, int64_t c, int64_t width, bool add) {
  constexpr int R = kTileRows;
  int64_t r = 0;
  for (; r + R <= m; r += R) Tile<R, V, Partial>(x, w, y, k_dim, n, r, k0, k1, c, width, add, r == 0);
  switch (m - r) {
    case 3: Tile<3, V, Partial>(x, w, y, k_dim, n, r, k0, k1, c, width, add, r == 0); break;
    case 2: Tile<2, V, Partial>(x, w, y, k_dim, n, r, k0, k1, c, width, add, r == 0); break;
    case 1: Tile<1, V, Partial>(x, w, y, k_dim, n, r, k0, k1, c, width, add, r == 0); break;
    default: break;
  }
}

#ifdef KVJAX_BF16_PAIRS
// The stored formats' form of Panel (bf16_pairs.h): rows k:k+2P of w, as P interleaved pairs,
// across columns c0:c1, 16 at a time. xp holds x's bfloat16 pairs, row stride half_k.
template <int P, typename W>
void PairPanel(const uint32_t* xp, const W* w, float* y, int64_t m, int64_t half_k, int64_t n, int64_t k,
               int64_t c0, int64_t c1, bool add, bool prefetch, __m512i interleave) {
  for (int64_t c = c0; c < c1; c += 16) {
    const int64_t width = std::min<int64_t>(16, c1 - c);
    const __mmask16 mask = kvjax::Mask16(width);
    __m512bh wv[P];
    for (int i = 0; i < P; ++i) wv[i] = kvjax::PairsOf(w + (k + 2 * i) * n + c, w + (k + 2 * i + 1) * n + c, width, interleave);
    if (prefetch)
      for (int i = 0; i < 2 * P; ++i) __builtin_prefetch(w + (k + 2 * P + i) * n + c, 0, 2);
    for (int64_t r = 0; r < m; ++r) {
      __m512 acc = add ? _mm512_maskz_loadu_ps(mask, y + r * n + c) : _mm512_setzero_ps();
      const uint32_t* xr = xp + r * half_k + k / 2;
      for (int i = 0; i < P; ++i) acc = _mm512_dpbf16_ps(acc, wv[i], (__m512bh)_mm512_set1_epi32(xr[i]));
      _mm512_mask_storeu_ps(y + r * n + c, mask, acc);
    }
  }
}

// The transposed form for J rows j0:j0+J of w [N, K] and R rows r0:r0+R of x (bfloat16 bits,
// row stride xk): each 32 values of the J rows of w are widened once for the R rows of x.
template <int J, int R, typename W>
void PairDots(const uint16_t* xb, const W* w, float* y, int64_t r0, int64_t xk, int64_t k_dim, int64_t n,
              int64_t j0) {
  __m512 acc[J][R];
  for (int j = 0; j < J; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; k += 32) {
    const int64_t width = std::min<int64_t>(32, k_dim - k);
    __m512bh wv[J];
    for (int j = 0; j < J; ++j) {
      wv[j] = kvjax::RowOf(w + (j0 + j) * k_dim + k, width);
      __builtin_prefetch(w + (j0 + j + 4 * J) * k_dim + k, 0, 2);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = kvjax::RowOf(xb + (r0 + r) * xk + k, width);
      for (int j = 0; j < J; ++j) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], wv[j], xv);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int r = 0; r < R; ++r) y[(r0 + r) * n + j0 + j] = _mm512_reduce_add_ps(acc[j][r]);
}
#endif

inline float LaneSum(Vec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float total = 0;
  for (int i = 0; i < kLanes; ++i) total += v[i];
  return total;
#endif
}

// The transposed form, y[r, j] = x[r, :] . w[j, :] for R rows r0:r0+R of x and J rows j0:j0+J of
// w [N, K]: each vector of the J rows of w is widened once and used for the R rows of x, each
// vector of x for the J rows of w (J x R sums in registers, J + R loads per J x R products).
template <int J, int R, typename W>
void DotRows(const float* x, const W* w, float* y, int64_t r0, int64_t k_dim, int64_t n, int64_t j0) {
  Vec acc[J][R] = {};
  for (int64_t k = 0; k < k_dim; k += kLanes) {
    const int64_t width = std::min<int64_t>(kLanes, k_dim - k);
    const bool full = width == kLanes;
    Vec wv[J];
    for (int j = 0; j < J; ++j) {
      const W* row = w + (j0 + j) * k_dim + k;
      wv[j] = full ? kvjax::LoadAs(row) : kvjax::LoadPartAs(row, width);
      __builtin_prefetch(row + 4 * J * k_dim, 0, 2);
    }
    for (int r = 0; r < R; ++r) {
      const float* xr = x + (r0 + r) * k_dim + k;
      const Vec xv = full ? kvjax::Load(xr) : kvjax::LoadPart(xr, width);
      for (int j = 0; j < J; ++j) acc[j][r] += xv * wv[j];
    }
  }
  for (int j = 0; j < J; ++j)
    for (int r = 0; r < R; ++r) y[(r0 + r) * n + j0 + j] = LaneSum(acc[j][r]);
}

// The transposed form's register blocks (DotRows): kDotRows rows of w by 4 rows of x, or, from
// kDotTall rows of x on, one row of w by kDotTall rows of x, whose sums fill AVX2's 16 registers
// without spilling (Zen 3, Gemma 3's and SmolLM2's heads at 8 rows: 4 x 4 spilled and ran at a
// third of the FMAs' rate). AVX-512's 32 registers hold 4 x 4.
constexpr int64_t kDotRows = kLanes == 16 ? 4 : 2;
constexpr int kDotTall = kLanes == 16 ? 0 : 8;

template <typename W>
struct Problem {
  const float* x;
  const W* w;
  float* y;
  int64_t m, k, n;
  int64_t band_rows;  // rows of w per band, one task each
  float* partial;     // [bands - 1, m, n]: the sums of bands 1, 2, ... (band 0's is y)
  const uint16_t* xb;  // x as bfloat16 bits [m, xk], xk = k rounded up to even; null for float32 w
  int64_t xk;

  // Whether the products go by bfloat16 pairs (bf16_pairs.h): stored formats, where the CPU has them.
  static constexpr bool kPairs =
#ifdef KVJAX_BF16_PAIRS
    !std::is_same_v<W, float>;
#else
    false;
#endif

  // Writes x[:, band] @ w[band, :] for band `t` into its own sum, a column chunk at a time.
  void RunBand(int64_t t) const {
    float* out = t == 0 ? y : partial + (t - 1) * m * n;
    const int64_t k0 = std::min(k, t * band_rows), k1 = std::min(k, k0 + band_rows);
    if (k0 == k1) {
      std::memset(out, 0, m * n * sizeof(float));
      return;
    }
    const int64_t chunk = std::max(kLanes, kChunkBytes / int64_t{sizeof(float)} / m / kLanes * kLanes);
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
      const int64_t c1 = std::min(n, c0 + chunk);
      int64_t r = k0;  // even: bands start at multiples of kPanel
#ifdef KVJAX_BF16_PAIRS
      if constexpr (kPairs) {
        // One row of x times int8 weights widens more cheaply to float32 than to bfloat16 pairs.
        if (m > 1 || !std::is_same_v<W, int8_t>) {
          const __m512i interleave = kvjax::InterleaveWords();
          const uint32_t* xp = reinterpret_cast<const uint32_t*>(xb);
          for (; r + kPanel <= k1; r += kPanel)
            PairPanel<kPanel / 2>(xp, w, out, m, xk / 2, n, r, c0, c1, r != k0, r + 2 * kPanel <= k1,
                                  interleave);
          for (; r + 2 <= k1; r += 2)
            PairPanel<1>(xp, w, out, m, xk / 2, n, r, c0, c1, r != k0, false, interleave);
        }
      }
#endif
      for (; r + kPanel <= k1; r += kPanel)
        Panel<kPanel>(x, w, out, m, k, n, r, c0, c1, r != k0, r + 2 * kPanel <= k1);
      for (; r < k1; ++r) Panel<1>(x, w, out, m, k, n, r, c0, c1, r != k0, false);
    }
  }

  // Several rows of x (without bfloat16 pairs): columns [t * band_rows, ...) of y, whole, by
  // register tiles (Tile) over kTileDepth rows of w at a time; band_rows is a multiple of the
  // tiles' span.
  void RunTileBand(int64_t t) const {
    constexpr int64_t span = kTileVectors * kLanes;
    const int64_t c0 = std::min(n, t * band_rows), c1 = std::min(n, c0 + band_rows);
    for (int64_t d0 = 0; d0 < k; d0 += kTileDepth) {
      const int64_t d1 = std::min(k, d0 + kTileDepth);
      const bool add = d0 != 0;
      int64_t c = c0;
      for (; c + span <= c1; c += span) TileRows<kTileVectors, false>(x, w, y, m, k, n, d0, d1, c, span, add);
      for (; c + kLanes <= c1; c += kLanes) TileRows<1, false>(x, w, y, m, k, n, d0, d1, c, kLanes, add);
      if (c < c1) TileRows<1, true>(x, w, y, m, k, n, d0, d1, c, c1 - c, add);
    }
  }

  // The transposed form: rows [t * band_rows, ...) of w [N, K] give those columns of y, whole.
  void RunTransposedBand(int64_t t) const {
    const int64_t j0 = std::min(n, t * band_rows), j1 = std::min(n, j0 + band_rows);
    int64_t j = j0;
    for (; j + kDotRows <= j1; j += kDotRows) Dots<kDotRows>(j);
    for (; j < j1; ++j) Dots<1>(j);
  }

  template <int J>
  void Dots(int64_t j) const {
    int64_t r = 0;
#ifdef KVJAX_BF16_PAIRS
    if constexpr (kPairs) {
      for (; r + 4 <= m; r += 4) PairDots<J, 4>(xb, w, y, r, xk, k, n, j);
      for (; r < m; ++r) PairDots<J, 1>(xb, w, y, r, xk, k, n, j);
      return;
    }
#endif
    if constexpr (kDotTall > 0)
      for (; r + kDotTall <= m; r += kDotTall)
        for (int i = 0; i < J; ++i) DotRows<1, kDotTall>(x, w, y, r, k, n, j + i);
    for (; r + 4 <= m; r += 4) DotRows<J, 4>(x, w, y, r, k, n, j);
    for (; r < m; ++r) DotRows<J, 1>(x, w, y, r, k, n, j);
  }
};

struct Split {
  int64_t band_rows, bands, workers;
};

// Rows of w (of `row_bytes` each) per band, and the bands and workers to share `rows` among.
// `alone`: the product stays on the calling thread. Several bands per thread let a thread that
// wakes late take fewer; at most `most_bands` (but one per thread). The bands depend on the shapes
// and the pool's size only, never on `alone`: a product gives the same bits on one thread or many.
Split Share(const ffi::ThreadPool& pool, bool alone, int64_t rows, int64_t row_bytes, int64_t align,
            int64_t most_bands) {
  // Waking a pool thread costs more than streaming a small slice of w: only weights of
  // kMinBytesPerThread or more per thread are worth sharing.
  const int64_t most = std::max<int64_t>(1, pool.num_threads());
  const int64_t threads = std::clamp<int64_t>(rows * row_bytes / kMinBytesPerThread, 1, most);
  const int64_t units = std::max<int64_t>(1, (rows + align - 1) / align);
  const int64_t bands = std::min({threads * kBandsPerThread, units, std::max(threads, most_bands)});
  const int64_t band_rows = (units + bands - 1) / bands * align;
  return {band_rows, bands, alone ? 1 : std::min(threads, bands)};
}

// Whether the pool's threads together read memory faster than one thread alone: on some machines
// one core streams at the machine's full rate (Zen 4 here), on others each core reads about half
// of it (Zen 3 here: a 671 MB matrix in 41 ms on one core, 21 ms on two). Measured once per
// process, the first time it is asked: a buffer larger than the caches summed on the calling
// thread, then split among the pool's threads, best of three each. Which way it goes changes only
// the threads a product runs on, never its bits (Share).
bool SharedReadsFaster(ffi::ThreadPool& pool) {
  static std::once_flag once;
  static bool faster = false;
  std::call_once(once, [&] {
    const int64_t workers = std::max<int64_t>(1, pool.num_threads());
    if (workers == 1) return;
    constexpr int64_t kFloats = int64_t{32} << 20;  // 128 MiB
    std::vector<float> buffer(kFloats, 1.0f);
    std::vector<float> sums(workers * 16);
    const auto read = [&](int64_t begin, int64_t end, int64_t worker) {
      Vec acc[4] = {};
      for (int64_t i = begin; i + 4 * kLanes <= end; i += 4 * kLanes)
        for (int j = 0; j < 4; ++j) acc[j] += kvjax::Load(buffer.data() + i + j * kLanes);
      sums[worker * 16] += LaneSum(acc[0] + acc[1] + acc[2] + acc[3]);
    };
    const auto seconds = [](auto fn) {
      double best = 1e30;
      for (int i = 0; i < 3; ++i) {
        const auto start = std::chrono::steady_clock::now();
        fn();
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      return best;
    };
    const double one = seconds([&] { read(0, kFloats, 0); });
    const int64_t slice = kFloats / workers;
    const double all = seconds([&] {
      kvjax::ParallelFor(pool, workers, workers, [&](int64_t t, int64_t worker) { read(t * slice, (t + 1) * slice, worker); });
    });
    faster = all < 0.8 * one;
    volatile float sink = sums[0];  // the sums are read: the loops are not dropped
    (void)sink;
  });
  return faster;
}

template <typename W>
void Multiply(ffi::ThreadPool& pool, const float* x, const uint16_t* xb, const W* w, float* y, int64_t m, int64_t k,
              int64_t n, bool transposed) {
  const int64_t xk = (k + 1) / 2 * 2;
  // A float32 matrix times one row is a multiply per weight read, bound by how fast w streams: where
  // one core reads at the machine's full rate, a pool thread would only add its wake-up to each of
  // a decode step's 200-odd products, so the product stays on the calling thread; where the cores
  // read faster together, it is shared (SharedReadsFaster). The stored formats' widening needs
  // every core's arithmetic.
  const bool alone = m == 1 && std::is_same_v<W, float> && !SharedReadsFaster(pool);
  if (transposed) {
    // Each band writes its own columns of y: no partial sums to add.
    const Split split = Share(pool, alone, n, k * int64_t{sizeof(W)}, kDotRows, n);
    const Problem<W> problem{x, w, y, m, k, n, split.band_rows, nullptr, xb, xk};
    kvjax::ParallelFor(pool, split.bands, split.workers,
                       [&](int64_t band, int64_t) { problem.RunTransposedBand(band); });
    return;
  }
  if (m > 1 && !Problem<W>::kPairs) {
    // Several rows: each band is a span of columns of y over all of w's rows, whole (no partial
    // sums to add; a sum's order is k's, whichever thread runs it).
    constexpr int64_t span = kTileVectors * kLanes;
    const Split split = Share(pool, false, n, k * int64_t{sizeof(W)}, span, n);
    const Problem<W> problem{x, w, y, m, k, n, split.band_rows, nullptr, xb, xk};
    kvjax::ParallelFor(pool, split.bands, split.workers, [&](int64_t band, int64_t) { problem.RunTileBand(band); });
    return;
  }
  const int64_t sum_bytes = std::max<int64_t>(1, m * n * int64_t{sizeof(float)});
  const Split split = Share(pool, alone, k, n * int64_t{sizeof(W)}, kPanel, 1 + kPartialBytes / sum_bytes);
  // Kept by the calling thread between calls: a fresh buffer each call would be paged in anew.
  // (Pool threads reach it through this pointer: a thread_local named there would be their own.)
  thread_local std::vector<float> kept;
  if (kept.size() < static_cast<size_t>((split.bands - 1) * m * n)) kept.resize((split.bands - 1) * m * n);
  float* const partial = kept.data();
  const Problem<W> problem{x, w, y, m, k, n, split.band_rows, partial, xb, xk};
  // Each band sums into its own buffer (band 0's is y); then the buffers are added in band order,
  // a slice of y per worker. The slices are the last tasks claimed: a thread that claims one
  // waits for the bands still running (each on a thread that has started).
  if (split.bands == 1) return kvjax::ParallelFor(pool, 1, 1, [&](int64_t, int64_t) { problem.RunBand(0); });
  const int64_t size = m * n, slices = split.workers, slice = (size + slices - 1) / slices;
  std::atomic<int64_t> done{0};
  kvjax::ParallelFor(pool, split.bands + slices, split.workers, [&](int64_t task, int64_t) {
    if (task < split.bands) {
      problem.RunBand(task);
      done.fetch_add(1, std::memory_order_release);
      return;
    }
    while (done.load(std::memory_order_acquire) < split.bands) std::this_thread::yield();
    const int64_t j0 = std::min(size, (task - split.bands) * slice), j1 = std::min(size, j0 + slice);
    for (int64_t i = 1; i < split.bands; ++i) {
      const float* p = partial + (i - 1) * size;
      for (int64_t j = j0; j < j1; ++j) y[j] += p[j];
    }
  });
}

// x rounded to the nearest bfloat16 (ties to even), as a float.
inline float RoundToBfloat16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7f800000u) != 0x7f800000u) bits += 0x7fffu + ((bits >> 16) & 1u);  // not inf / nan
  bits &= 0xffff0000u;
  std::memcpy(&x, &bits, sizeof(bits));
  return x;
}

ffi::Error SmallMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                       ffi::ResultBuffer<ffi::F32> y, bool transposed) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[transposed ? 1 : 0])
    return ffi::Error::InvalidArgument("kvjax_small_matmul expects x [M, K] and w [K, N] ([N, K] transposed)");
  const int64_t m = xd[0], k = xd[1], n = wd[transposed ? 0 : 1];
  if (scale.element_count() != 0 && scale.element_count() != n)
    return ffi::Error::InvalidArgument("kvjax_small_matmul expects one scale per output column, or none");
  if (m * n == 0) return ffi::Error::Success();
  float* out = y->typed_data();
  const float* xs = x.typed_data();
  // With a stored format: x rounded to bfloat16, as floats and as bits [m, xk] (a zero appended
  // to rows of odd length, so each pair is one uint32).
  const int64_t xk = (k + 1) / 2 * 2;
  std::vector<float> rounded;
  std::vector<uint16_t> bits;
  if (w.element_type() != ffi::DataType::F32) {
    rounded.resize(m * k);
    bits.assign(m * xk, 0);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = 0; i < k; ++i) {
        const float value = RoundToBfloat16(xs[r * k + i]);
        uint32_t word;
        std::memcpy(&word, &value, sizeof(word));
        rounded[r * k + i] = value;
        bits[r * xk + i] = static_cast<uint16_t>(word >> 16);
      }
    xs = rounded.data();
  }
  if (k == 0) {
    std::memset(out, 0, m * n * sizeof(float));
    return ffi::Error::Success();
  }
  switch (w.element_type()) {
    case ffi::DataType::F32:
      Multiply(pool, xs, bits.data(), static_cast<const float*>(w.untyped_data()), out, m, k, n, transposed);
      break;
    case ffi::DataType::BF16:
      Multiply(pool, xs, bits.data(), static_cast<const uint16_t*>(w.untyped_data()), out, m, k, n, transposed);
      break;
    case ffi::DataType::S8:
      Multiply(pool, xs, bits.data(), static_cast<const int8_t*>(w.untyped_data()), out, m, k, n, transposed);
      break;
    default:
      return ffi::Error::InvalidArgument("kvjax_small_matmul takes weights in float32, bfloat16 or int8");
  }
  if (scale.element_count() != 0) {
    const float* s = scale.typed_data();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < n; ++j) out[r * n + j] *= s[j];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxSmallMatmul, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transposed"));
