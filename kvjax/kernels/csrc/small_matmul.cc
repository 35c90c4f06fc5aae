// kvjax_small_matmul: y[M, N] = x[M, K] @ w[K, N] in float32 for small M (decode-step rows).
//
// An XLA FFI handler for the CPU. At decode batch sizes the weights are read once per step and
// the product is bound by how fast they stream from memory; XLA's CPU dot runs these shapes
// far below the machine's bandwidth (figures in docs/results.md). This kernel reads w in
// its row-major [K, N] layout and in order: each thread takes a band of consecutive rows of w
// (the bands' partial products are summed at the end) and walks it kPanel rows at a time across
// a chunk of columns, adding each row of x times the panel into y's chunk, which stays in L1.
// Whole rows read in order let the hardware prefetchers stream w; column tiles, a few hundred
// bytes of each row at a time, give them only short runs.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

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

// y[:, c:c+width] = (or += when add) x[:, k:k+P] @ w[k:k+P, c:c+width] for width = kLanes, or
// the first `width` < kLanes columns when Partial. x has row stride k_dim; w and y have n. With
// `prefetch`, the same columns of the next P rows are fetched into L2 meanwhile: the hardware
// prefetchers alone do not keep 8 row streams at the memory's rate.
template <int P, bool Partial>
inline void Column(const float* x, const float* w, float* y, int64_t m, int64_t k_dim, int64_t n,
                   int64_t k, int64_t c, int64_t width, bool add, bool prefetch) {
  const auto load = [width](const float* p) { return Partial ? kvjax::LoadPart(p, width) : kvjax::Load(p); };
  Vec wv[P];
  for (int i = 0; i < P; ++i) wv[i] = load(w + (k + i) * n + c);
  if (prefetch)
    for (int i = 0; i < P; ++i) __builtin_prefetch(w + (k + P + i) * n + c, 0, 2);
  for (int64_t r = 0; r < m; ++r) {
    Vec acc = add ? load(y + r * n + c) : Vec{};
    const float* xr = x + r * k_dim + k;
    for (int i = 0; i < P; ++i) acc += xr[i] * wv[i];
    if (Partial) kvjax::StorePart(y + r * n + c, acc, width);
    else kvjax::Store(y + r * n + c, acc);
  }
}

// Rows k:k+P of w across columns c0:c1.
template <int P>
void Panel(const float* x, const float* w, float* y, int64_t m, int64_t k_dim, int64_t n, int64_t k,
           int64_t c0, int64_t c1, bool add, bool prefetch) {
  int64_t c = c0;
  for (; c + kLanes <= c1; c += kLanes) Column<P, false>(x, w, y, m, k_dim, n, k, c, kLanes, add, prefetch);
  if (c < c1) Column<P, true>(x, w, y, m, k_dim, n, k, c, c1 - c, add, prefetch);
}

struct Problem {
  const float* x;
  const float* w;
  float* y;
  int64_t m, k, n;
  int64_t band_rows;  // rows of w per band, one task each
  float* partial;     // [workers - 1, m, n]: the sums of the bands of workers 1, 2, ...

  // Adds x[:, band] @ w[band, :] for band `t` into worker `i`'s sum (or writes it, when first),
  // a column chunk at a time.
  void RunBand(int64_t t, int64_t i, bool first) const {
    float* out = i == 0 ? y : partial + (i - 1) * m * n;
    const int64_t k0 = std::min(k, t * band_rows), k1 = std::min(k, k0 + band_rows);
    if (k0 == k1) {
      if (first) std::memset(out, 0, m * n * sizeof(float));
      return;
    }
    const int64_t chunk = std::max(kLanes, kChunkBytes / int64_t{sizeof(float)} / m / kLanes * kLanes);
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
      const int64_t c1 = std::min(n, c0 + chunk);
      int64_t r = k0;
      for (; r + kPanel <= k1; r += kPanel)
        Panel<kPanel>(x, w, out, m, k, n, r, c0, c1, !first || r != k0, r + 2 * kPanel <= k1);
      for (; r < k1; ++r) Panel<1>(x, w, out, m, k, n, r, c0, c1, !first || r != k0, false);
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
  if (m * n == 0) return ffi::Error::Success();
  // Waking a pool thread costs more than streaming a small slice of w: only weights of
  // kMinBytesPerThread or more per thread are worth sharing.
  const int64_t threads = std::clamp<int64_t>(k * n * int64_t{sizeof(float)} / kMinBytesPerThread, 1,
                                              std::max<int64_t>(1, pool.num_threads()));
  const int64_t panels = std::max<int64_t>(1, (k + kPanel - 1) / kPanel);
  const int64_t bands = std::min(threads * kBandsPerThread, panels);
  const int64_t band_rows = (panels + bands - 1) / bands * kPanel;
  const int64_t workers = std::min(threads, bands);

  std::vector<float> partial((workers - 1) * m * n);
  const Problem problem{x.typed_data(), w.typed_data(), y->typed_data(), m, k, n, band_rows, partial.data()};
  // Each worker sums its bands in its own buffer (worker 0's is y); the buffers are added at the end.
  std::vector<char> used(workers, 0);  // per worker: whether its buffer holds a sum
  kvjax::ParallelFor(pool, bands, workers, [&](int64_t band, int64_t worker) {
    problem.RunBand(band, worker, !used[worker]);
    used[worker] = 1;
  });
  if (!used[0]) std::memset(problem.y, 0, m * n * sizeof(float));
  for (int64_t i = 1; i < workers; ++i)
    if (used[i])
      for (int64_t j = 0; j < m * n; ++j) problem.y[j] += partial[(i - 1) * m * n + j];
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxSmallMatmul, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
