// kvjax_small_matmul: y[M, N] = x[M, K] @ w[K, N] in float32 for small M (decode-step rows).
//
// An XLA FFI handler for the CPU. At decode batch sizes the weights are read once per step and
// the product is bound by how fast they stream from memory; XLA's CPU dot runs these shapes
// far below the machine's bandwidth (see kvjax/matmul.py for figures). This kernel reads w in
// its row-major [K, N] layout, no packing: each task owns a column tile (up to 192 floats with
// AVX-512), walks k down the rows with the next rows prefetched, and keeps two rows of x times
// the tile in vector registers (four rows times half as wide a tile from 16 rows of x on); the
// other rows of x reuse each block of 32 weight rows from L1. Tiles are shared out over XLA's
// intra-op thread pool.

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Vectors of 16 floats with AVX-512 (32 registers), else of 8 (16 registers on AVX2): the
// register tiles below (rows of x times vectors) stay within the registers either way.
#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
constexpr int64_t kMaxVectors = 12;  // vectors per column tile: 2 rows x 12 accumulators
constexpr int64_t kMaxVectors4 = 6;  // or, from kRowsForFour rows of x, 4 rows x 6
#else
constexpr int64_t kLanes = 8;
constexpr int64_t kMaxVectors = 6;
constexpr int64_t kMaxVectors4 = 3;
#endif
constexpr int64_t kRowsForFour = 16;
constexpr int64_t kPrefetchRows = 8;
constexpr int64_t kBlockRows = 32;  // rows of w reused from L1 by every row group of x
constexpr int64_t kMinBytesPerThread = 64 << 10;

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec Load(const float* p) { Vec v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

// Adds x[r, k0:k1] @ w[k0:k1, 0:kLanes*NV] to y[r, 0:kLanes*NV] (or writes it, when k0 == 0)
// for rows r < MR; x has row stride k_dim, w and y have row stride n. The first row group of
// each block prefetches the rows ahead; later groups find the block's rows in L1.
template <int MR, int NV>
void Block(const float* x, const float* w, float* y, int64_t k_dim, int64_t n, int64_t k0,
           int64_t k1, bool prefetch) {
  Vec acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = k0 == 0 ? Vec{} : Load(y + r * n + kLanes * j);
  w += k0 * n;
  for (int64_t k = k0; k < k1; ++k, w += n) {
    if (prefetch)
      for (int j = 0; j < NV; ++j) __builtin_prefetch(w + kPrefetchRows * n + kLanes * j);
    Vec wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = Load(w + kLanes * j);
    for (int r = 0; r < MR; ++r) {
      const float b = x[r * k_dim + k];
      for (int j = 0; j < NV; ++j) acc[r][j] += b * wv[j];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) Store(y + r * n + kLanes * j, acc[r][j]);
}

// y[0:m, 0:kLanes*NV] = x[0:m, :] @ w[:, 0:kLanes*NV], k in blocks of kBlockRows, two (or four)
// rows of x at a time.
template <int NV>
void Tile(const float* x, const float* w, float* y, int64_t m, int64_t k_dim, int64_t n) {
  for (int64_t k0 = 0; k0 < k_dim; k0 += kBlockRows) {
    const int64_t k1 = std::min(k_dim, k0 + kBlockRows);
    int64_t r = 0;
    if constexpr (NV <= kMaxVectors4)
      if (m >= kRowsForFour)
        for (; r + 4 <= m; r += 4) Block<4, NV>(x + r * k_dim, w, y + r * n, k_dim, n, k0, k1, r == 0);
    for (; r + 2 <= m; r += 2) Block<2, NV>(x + r * k_dim, w, y + r * n, k_dim, n, k0, k1, r == 0);
    if (r < m) Block<1, NV>(x + r * k_dim, w, y + r * n, k_dim, n, k0, k1, r == 0);
  }
}

// Tile<1> ... Tile<kMaxVectors>, indexed by tile width - 1.
template <size_t... I>
constexpr auto TilesOfWidth(std::index_sequence<I...>) {
  return std::array{&Tile<static_cast<int>(I) + 1>...};
}
constexpr auto kTiles = TilesOfWidth(std::make_index_sequence<kMaxVectors>{});

// Like Block<1, 1> over the last n % kLanes columns: y[r, c0:n] = x[r, :] @ w[:, c0:n] for r < m.
void Tail(const float* x, const float* w, float* y, int64_t m, int64_t k_dim, int64_t n, int64_t c0) {
  const size_t bytes = (n - c0) * sizeof(float);
  for (int64_t r = 0; r < m; ++r) {
    Vec acc = {};
    for (int64_t k = 0; k < k_dim; ++k) {
      Vec wv = {};
      std::memcpy(&wv, w + k * n + c0, bytes);
      acc += x[r * k_dim + k] * wv;
    }
    float out[kLanes];
    Store(out, acc);
    std::memcpy(y + r * n + c0, out, bytes);
  }
}

// y = x @ w, cut into column tiles.
struct Problem {
  const float* x;
  const float* w;
  float* y;
  int64_t m, k, n;
  int64_t tile_vectors;  // vectors per column tile
  int64_t num_tiles;     // the last tile also covers the columns past the last full vector

  void RunTile(int64_t t) const {
    const int64_t col = t * tile_vectors * kLanes;
    const int64_t nv = std::min(tile_vectors, n / kLanes - t * tile_vectors);
    if (nv > 0) kTiles[nv - 1](x, w + col, y + col, m, k, n);
    if (t == num_tiles - 1 && n % kLanes) Tail(x, w, y, m, k, n, n / kLanes * kLanes);
  }
};

// Tiles claimed from a shared counter; a pool task that starts after all are claimed returns
// at once, so the caller never waits on a task that has not started (no deadlock when every
// pool thread is itself inside this kernel).
struct Shared {
  Problem problem;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};

  void Work() {
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < problem.num_tiles;) {
      problem.RunTile(t);
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error SmallMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("kvjax_small_matmul expects x [M, K] and w [K, N]");
  const int64_t m = xd[0], k = xd[1], n = wd[1];
  if (k == 0) {
    std::memset(y->typed_data(), 0, m * n * sizeof(float));
    return ffi::Error::Success();
  }
  // A pool thread takes 10-20 us to wake: only weights of kMinBytesPerThread or more per thread
  // are worth sharing.
  const int64_t threads = std::clamp<int64_t>(k * n * int64_t{sizeof(float)} / kMinBytesPerThread, 1,
                                              std::max<int64_t>(1, pool.num_threads()));
  const int64_t vectors = n / kLanes;
  // At least one tile per thread, each at most max_vectors wide, in a multiple of the threads.
  const int64_t max_vectors = m >= kRowsForFour ? kMaxVectors4 : kMaxVectors;
  int64_t tiles = std::max<int64_t>(threads, (vectors + max_vectors - 1) / max_vectors);
  tiles = (tiles + threads - 1) / threads * threads;
  const int64_t tile_vectors = std::max<int64_t>(1, (vectors + tiles - 1) / tiles);
  const int64_t num_tiles = std::max<int64_t>(1, (vectors + tile_vectors - 1) / tile_vectors);

  auto shared = std::make_shared<Shared>();
  shared->problem = {x.typed_data(), w.typed_data(), y->typed_data(), m, k, n, tile_vectors, num_tiles};
  for (int64_t i = 1; i < std::min(threads, num_tiles); ++i) pool.Schedule([shared] { shared->Work(); });
  shared->Work();
  while (shared->finished.load(std::memory_order_acquire) < num_tiles) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxSmallMatmul, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
