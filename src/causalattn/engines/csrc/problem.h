// One attention problem as the native kernels read it: tensors, the pattern's data, the
// modifiers and dropout. Nothing here states a rule of M: who may read whom arrives as data
// from causalattn.masks.Pattern (per-row readable intervals lo <= j < hi, the key padding
// vector, per-tile kinds, dense masks only for partial tiles); see causalattn/engines/cpp.py.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <optional>
#include <vector>

#include "score_mod.h"
#include "simd.h"

namespace causalattn {

// From causalattn/constants.py, as simd.h's LOG2E and LN2 (-DCAUSALATTN_<NAME>).
// Tile kinds on the bq × bk grid: skipped, fully readable, partly readable through the
// dense mask, and from PARTIAL_TILE on: partly readable through tile mask (kind - PARTIAL_TILE).
enum : int32_t {
  SKIP = CAUSALATTN_SKIP,
  FULL = CAUSALATTN_FULL,
  PARTIAL_DENSE = CAUSALATTN_PARTIAL_DENSE,
  PARTIAL_TILE = CAUSALATTN_PARTIAL_TILE
};

// rel_bias rows' padding on each side (>= any NR): a vector load at a panel's last real
// column stays inside the row
constexpr int64_t REL_PAD = 64;

// What the backward also returns (Options::want bits): d slopes, dZ (for d bias), d rel_bias
enum : int64_t { WANT_SLOPES = 1, WANT_BIAS = 2, WANT_REL = 4 };

template <typename T>
inline int64_t round_up(int64_t n) {
  return (n + NR<T> - 1) / NR<T> * NR<T>;
}

// A strided (B, H, T, x) view of a tensor's data.
template <typename I>
struct View4 {
  const I* p = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0, s3 = 1;
  View4() = default;
  explicit View4(const at::Tensor& t)
      : p(static_cast<const I*>(t.data_ptr())),
        s0(t.stride(0)),
        s1(t.stride(1)),
        s2(t.stride(2)),
        s3(t.stride(3)) {}
  const I* row(int64_t b, int64_t h, int64_t i) const { return p + b * s0 + h * s1 + i * s2; }
};

// The dropout keep decision of causalattn.dropout, bit for bit: MurmurHash3's fmix32 in
// three levels over (seed, offset, b, h), the global row and the global column.
constexpr uint32_t HASH_C1 = CAUSALATTN_HASH_C1, HASH_C2 = CAUSALATTN_HASH_C2;
constexpr uint32_t HASH_GOLD = CAUSALATTN_HASH_GOLD, HASH_ROW = CAUSALATTN_HASH_ROW,
                   HASH_COL = CAUSALATTN_HASH_COL, HASH_OFFSET = CAUSALATTN_HASH_OFFSET;
inline uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= HASH_C1;
  x ^= x >> 13;
  x *= HASH_C2;
  x ^= x >> 16;
  return x;
}
inline uint32_t head_key(uint32_t seed, uint32_t offset, int64_t b, int64_t h) {
  return fmix32(fmix32(uint32_t(b) * HASH_GOLD + uint32_t(h) + offset * HASH_OFFSET) ^ seed);
}
inline uint32_t row_key(uint32_t head, int64_t pos) {
  return fmix32(head ^ (uint32_t(pos) * HASH_GOLD + HASH_ROW));
}
inline uint32_t col_key(int64_t pos) { return fmix32(uint32_t(pos) * HASH_GOLD + HASH_COL); }

struct Problem {
  int64_t B = 0, Hq = 0, Hkv = 0, g = 1, Tq = 0, Tk = 0, dk = 0, dv = 0;
  at::ScalarType dtype;
  at::Tensor q, k, v;
  // readable intervals lo <= j < hi, int64 (Bi, Tq) with Bi in {1, B}
  const int64_t* lo = nullptr;
  const int64_t* hi = nullptr;
  int64_t lo_b = 0;  // batch stride of lo, hi (0 when shared)
  const bool* key_padding = nullptr;  // (B, Tk), True = may read; null: none
  // tile kinds int32 (Bm, Hm, nQB, nKB) on the bq × bk grid; null: every tile FULL
  const int32_t* kinds = nullptr;
  int64_t kinds_b = 0, kinds_h = 0, nQB = 0, nKB = 0;
  const bool* mask = nullptr;  // dense (Bm, Hm, Tq, Tk): read in PARTIAL_DENSE tiles
  int64_t mask_b = 0, mask_h = 0;
  const bool* tile_masks = nullptr;  // (n, bq, bk): read in PARTIAL_TILE tiles
  int64_t bq = 64, bk = 128;  // the grid of kinds (and the forward's blocks)
  double scale = 1, softcap = 0;  // softcap 0: none
  const double* slopes = nullptr;  // ALiBi (B|1, Hq); null: none
  int64_t slopes_b = 0;
  const double* sinks = nullptr;  // (Hq); null: none
  // additive bias in the compute type, read bias[b·s0 + h·s1 + i·s2 + j·s3] (strides 0 on
  // broadcast axes), natural units; null: none
  const void* bias = nullptr;
  int64_t bias_s[4] = {0, 0, 0, 0};
  std::vector<int64_t> bias_sizes;  // its 4-D shape (1 on broadcast axes)
  // rel_bias (Hq, R) in the compute type, ·log2 e, each row reversed between REL_PAD
  // padding values on both sides: the NR query columns of one head at consecutive positions
  // read one contiguous vector (see Cols::roff); null: none
  const void* rel = nullptr;
  int64_t rel_ld = 0;
  int64_t q_start = 0, k_start = 0;  // global positions of query 0 and key 0
  uint32_t drop_thr = 0;  // dropout: cells whose 24-bit hash is below this are dropped
  double drop_scale = 1;  // 1 / (1 - p), 0 for p = 1
  uint32_t seed = 0, offset = 0;
  bool dropout = false;
  ScoreProg smod;  // the score_mod's program (score_mod.h); off: none

  const int64_t* lo_row(int64_t b) const { return lo + b * lo_b; }
  const int64_t* hi_row(int64_t b) const { return hi + b * lo_b; }
  int32_t kind(int64_t b, int64_t h, int64_t qb, int64_t kb) const {
    return kinds ? kinds[b * kinds_b + h * kinds_h + qb * nKB + kb] : int32_t(FULL);
  }
  // Whether query row i (head h) of batch row b may read key j, beyond its interval: the
  // key padding, then the tile's kind (the dense mask or a tile mask where partial).
  bool allowed(int64_t b, int64_t h, int64_t i, int64_t j, int32_t kind) const {
    if (key_padding && !key_padding[b * Tk + j]) return false;
    if (kind == FULL) return true;
    if (kind == SKIP) return false;
    if (kind == PARTIAL_DENSE) return mask[b * mask_b + h * mask_h + i * Tk + j];
    return tile_masks[(int64_t(kind - PARTIAL_TILE) * bq + i % bq) * bk + j % bk];
  }
  bool has_extra() const { return key_padding != nullptr || kinds != nullptr; }
};

// A pass's options, set by Python (causalattn/engines/cpp.py) from the shape only.
struct Options {
  int64_t bq, bk;   // the pass's blocks: query rows per head, keys per tile
  int64_t splits;   // forward: key splits per (b, kv head) when decoding, else 1
  int64_t lanes;    // backward: dQ partial sums per (b, kv head)
  bool decode;      // forward: few query rows, K and V read in place, split over keys
  int64_t want = 0;  // backward: WANT_* bits
};

Problem make_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& lo, const at::Tensor& hi,
                     const std::optional<at::Tensor>& key_padding,
                     const std::optional<at::Tensor>& kinds,
                     const std::optional<at::Tensor>& mask,
                     const std::optional<at::Tensor>& tile_masks,
                     const std::optional<at::Tensor>& slopes,
                     const std::optional<at::Tensor>& sinks,
                     const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& rel, double scale, double softcap,
                     int64_t q_start, int64_t k_start, int64_t drop_thr, double drop_scale,
                     int64_t seed, int64_t offset, int64_t bq, int64_t bk);

// Runs fn(task, worker) for every task of `order` on at::parallel_for's threads, each
// thread taking the next task in `order` (dynamic scheduling, largest tasks first): which
// thread runs a task changes nothing in its result, so the bits never depend on the
// thread count. `worker` is the thread's slot in [0, threads).
template <typename F>
void run_tasks(const std::vector<int64_t>& order, int64_t work, F&& fn) {
  const int64_t n = int64_t(order.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || work < (int64_t(1) << 18)) {  // tiny: no parallel region at all
    for (int64_t t = 0; t < n; ++t) fn(order[t], 0);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      for (int64_t t = next++; t < n; t = next++) fn(order[t], w);
    }
  });
}

// Task indices sorted by decreasing cost (stable: ties keep their index order).
inline std::vector<int64_t> by_cost(const std::vector<int64_t>& cost) {
  std::vector<int64_t> order(cost.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  return order;
}

// A per-thread scratch buffer that only grows: reused across calls, so a call does not
// page-fault fresh memory for every tile buffer. 64-byte aligned: the micro-kernel's vector
// loads then never straddle a cache line.
template <typename T>
T* scratch(std::vector<T>& buf, size_t n) {
  constexpr size_t pad = 64 / sizeof(T);
  if (buf.size() < n + pad) buf.resize(n + pad);
  const uintptr_t a = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<T*>((a + 63) & ~uintptr_t(63));
}

// K, V of one (b, kv head) packed for the micro-kernel, in the compute type T:
// Kp [key panel][d_k][NR] (B operand of S = Q Kᵀ) and Vp [d_v panel][key][NR] (B operand
// of P V), zero-padded to whole panels. Non-finite values are zeroed in Vp (zero weights
// must not meet them) and marked in `vbad`; the readable ones are added back exactly.
template <typename I, typename T>
void pack_kt(const I* K, int64_t ld, int64_t s3, int64_t Tk, int64_t dk, T* Kp) {
  constexpr int nr = NR<T>;
  const int64_t panels = (Tk + nr - 1) / nr;
  for (int64_t p = 0; p < panels; ++p) {
    T* dst = Kp + p * dk * nr;
    for (int64_t n = 0; n < nr; ++n) {
      const int64_t j = p * nr + n;
      if (j < Tk) {
        const I* src = K + j * ld;
        for (int64_t x = 0; x < dk; ++x) dst[x * nr + n] = T(src[x * s3]);
      } else {
        for (int64_t x = 0; x < dk; ++x) dst[x * nr + n] = T(0);
      }
    }
  }
}

template <typename I, typename T>
void pack_n(const I* X, int64_t ld, int64_t s3, int64_t n_rows, int64_t rows_pad, int64_t cols,
            T* Xp, uint8_t* bad) {
  // Xp [col panel][row][NR]: the rows of X as the K dimension, its columns in panels
  constexpr int nr = NR<T>;
  const int64_t panels = (cols + nr - 1) / nr;
  for (int64_t r = 0; r < rows_pad; ++r) {
    const I* src = X + r * ld;
    uint8_t nonfinite = 0;
    for (int64_t p = 0; p < panels; ++p) {
      T* dst = Xp + (p * rows_pad + r) * nr;
      for (int64_t n = 0; n < nr; ++n) {
        const int64_t c = p * nr + n;
        T x = (r < n_rows && c < cols) ? T(src[c * s3]) : T(0);
        if (!std::isfinite(x)) {
          nonfinite = 1;
          x = T(0);
        }
        dst[n] = x;
      }
    }
    if (bad && r < n_rows) bad[r] = nonfinite;
  }
}

}  // namespace causalattn
