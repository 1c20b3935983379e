// A score_mod as the kernels run it: a straight-line program over registers of NR query
// lanes (causalattn/engines/score_program.py traces it; the op codes are its OPS, in order).
// Registers 0..4 hold score (natural units), b, h, q_idx, kv_idx. Instructions that depend
// on neither the score nor kv_idx ("invariant") run once per panel of columns; the others
// once per key. The reverse sweep (vjp) turns d output into d score and adds the captured
// tensors' gradients into a task's own buffer, in the task's fixed order.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace causalattn {

enum : int64_t {
  OP_CONST, OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_NEG, OP_TANH, OP_EXP, OP_LOG, OP_ABS,
  OP_SQRT, OP_POW, OP_SIN, OP_COS, OP_WHERE, OP_LT, OP_LE, OP_GT, OP_GE, OP_EQ, OP_NE,
  OP_AND, OP_OR, OP_NOT, OP_GATHER, OP_SIGMOID, OP_MAX, OP_MIN, OP_FLOORDIV, OP_MOD
};
constexpr int64_t SMOD_COLS = 8;  // op, dst, a0..a3, aux, varies
constexpr int64_t SMOD_META = 10;  // per table: offset, dim, sizes[4], strides[4]

struct ScoreProg {
  const int64_t* code = nullptr;  // (n, SMOD_COLS); null: no score_mod
  int64_t n = 0, regs = 0, out = 0;
  const double* consts = nullptr;
  const void* data = nullptr;  // every table, flat, in the compute type
  const int64_t* meta = nullptr;  // (tables, SMOD_META)
  int64_t ntab = 0, numel = 0;  // tables, their elements together
  int64_t grad = 0;  // bit t: table t's gradient is wanted (backward)
  int* bad = nullptr;  // set when a readable cell indexes a table out of range
  bool on() const { return code != nullptr; }
};

// One panel's registers and adjoints: r, g per lane (NR wide, the per-key path and the
// invariant instructions), rb, gb per block of CH key rows (CH·NR wide: the block path, the
// invariant registers copied to every row); ga the invariant adjoints summed over the keys.
template <typename T>
struct SmodState {
  static constexpr int nr = NR<T>;
  static constexpr int CH = 8;  // key rows per block
  std::vector<T> r, g, ga, rb, gb, tmp;
  std::vector<uint8_t> varies, live;
};

template <typename T>
inline int64_t smod_flat(const ScoreProg& S, const int64_t* c, const T* r, int64_t W, int64_t e,
                         bool& oob) {
  const int64_t* m = S.meta + c[6] * SMOD_META;
  int64_t flat = m[0];
  for (int64_t d = 0; d < m[1]; ++d) {
    int64_t ix = int64_t(r[c[2 + d] * W + e]);  // exact integers: index arithmetic
    if (ix < 0) ix += m[2 + d];  // torch's negative indices
    if (uint64_t(ix) >= uint64_t(m[2 + d])) {
      oob = true;
      ix = 0;
    }
    flat += ix * m[6 + d];
  }
  return flat;
}

// d[l] = t[i0·s0 + i1·s1] for indices a[l], b[l] (negative ones from the end); out of
// range reads t[0] and is counted in the result (branch-free: the loop vectorizes)
template <bool TWO, typename T>
inline int32_t gather2(const T* __restrict t, const T* __restrict a, const T* __restrict b,
                       int32_t n0, int32_t n1, int32_t s0, int32_t s1, T* __restrict d,
                       int64_t W) {
  int32_t any = 0;
  for (int64_t l = 0; l < W; ++l) {
    int32_t i0 = int32_t(a[l]), i1 = TWO ? int32_t(b[l]) : 0;
    i0 += i0 < 0 ? n0 : 0;
    i1 += i1 < 0 ? n1 : 0;
    const int32_t out = (uint32_t(i0) >= uint32_t(n0)) | (uint32_t(i1) >= uint32_t(n1));
    any |= out;
    d[l] = t[out ? 0 : i0 * s0 + i1 * s1];
  }
  return any;
}

// Run the instructions whose `varies` flag is `which` (0: once per panel, 1: per key) on
// registers of width W (register i at r + i·W); read(e) says whether element e is a read
// cell (an index out of range counts only there).
template <typename T, typename Read>
inline void smod_run(const ScoreProg& S, T* r, int64_t W, int64_t which, Read&& read) {
  const T* tab = static_cast<const T*>(S.data);
  for (int64_t k = 0; k < S.n; ++k) {
    const int64_t* c = S.code + k * SMOD_COLS;
    if (c[7] != which) continue;
    T* __restrict d = r + c[1] * W;
    const T* __restrict a = c[2] >= 0 ? r + c[2] * W : nullptr;
    const T* __restrict b = c[3] >= 0 ? r + c[3] * W : nullptr;
    const T* __restrict e = c[4] >= 0 ? r + c[4] * W : nullptr;
    switch (c[0]) {
      case OP_CONST: std::fill_n(d, W, T(S.consts[c[6]])); break;
      case OP_ADD: for (int64_t l = 0; l < W; ++l) d[l] = a[l] + b[l]; break;
      case OP_SUB: for (int64_t l = 0; l < W; ++l) d[l] = a[l] - b[l]; break;
      case OP_MUL: for (int64_t l = 0; l < W; ++l) d[l] = a[l] * b[l]; break;
      case OP_DIV: for (int64_t l = 0; l < W; ++l) d[l] = a[l] / b[l]; break;
      case OP_NEG: for (int64_t l = 0; l < W; ++l) d[l] = -a[l]; break;
      case OP_TANH:
        for (int64_t l = 0; l < W; l += Vec<T>::N) vstore(d + l, tanhv(vload(a + l)));
        break;
      case OP_EXP:
        for (int64_t l = 0; l < W; l += Vec<T>::N)
          vstore(d + l, exp2v(vload(a + l) * T(LOG2E)));
        break;
      case OP_LOG: for (int64_t l = 0; l < W; ++l) d[l] = std::log(a[l]); break;
      case OP_ABS: for (int64_t l = 0; l < W; ++l) d[l] = a[l] < T(0) ? -a[l] : a[l]; break;
      case OP_SQRT: for (int64_t l = 0; l < W; ++l) d[l] = std::sqrt(a[l]); break;
      case OP_POW: {
        const T p = T(S.consts[c[6]]);
        if (p == T(2))
          for (int64_t l = 0; l < W; ++l) d[l] = a[l] * a[l];
        else
          for (int64_t l = 0; l < W; ++l) d[l] = std::pow(a[l], p);
        break;
      }
      case OP_SIN: for (int64_t l = 0; l < W; ++l) d[l] = std::sin(a[l]); break;
      case OP_COS: for (int64_t l = 0; l < W; ++l) d[l] = std::cos(a[l]); break;
      case OP_WHERE: for (int64_t l = 0; l < W; ++l) d[l] = a[l] != T(0) ? b[l] : e[l]; break;
      case OP_LT: for (int64_t l = 0; l < W; ++l) d[l] = a[l] < b[l] ? T(1) : T(0); break;
      case OP_LE: for (int64_t l = 0; l < W; ++l) d[l] = a[l] <= b[l] ? T(1) : T(0); break;
      case OP_GT: for (int64_t l = 0; l < W; ++l) d[l] = a[l] > b[l] ? T(1) : T(0); break;
      case OP_GE: for (int64_t l = 0; l < W; ++l) d[l] = a[l] >= b[l] ? T(1) : T(0); break;
      case OP_EQ: for (int64_t l = 0; l < W; ++l) d[l] = a[l] == b[l] ? T(1) : T(0); break;
      case OP_NE: for (int64_t l = 0; l < W; ++l) d[l] = a[l] != b[l] ? T(1) : T(0); break;
      case OP_AND:
        for (int64_t l = 0; l < W; ++l) d[l] = (a[l] != T(0) && b[l] != T(0)) ? T(1) : T(0);
        break;
      case OP_OR:
        for (int64_t l = 0; l < W; ++l) d[l] = (a[l] != T(0) || b[l] != T(0)) ? T(1) : T(0);
        break;
      case OP_NOT: for (int64_t l = 0; l < W; ++l) d[l] = a[l] == T(0) ? T(1) : T(0); break;
      case OP_SIGMOID:
        for (int64_t l = 0; l < W; ++l) d[l] = T(1) / (T(1) + std::exp(-a[l]));
        break;
      case OP_MAX: for (int64_t l = 0; l < W; ++l) d[l] = a[l] > b[l] ? a[l] : b[l]; break;
      case OP_MIN: for (int64_t l = 0; l < W; ++l) d[l] = a[l] < b[l] ? a[l] : b[l]; break;
      case OP_FLOORDIV: for (int64_t l = 0; l < W; ++l) d[l] = std::floor(a[l] / b[l]); break;
      case OP_MOD:
        for (int64_t l = 0; l < W; ++l) d[l] = a[l] - std::floor(a[l] / b[l]) * b[l];
        break;
      case OP_GATHER: {
        const int64_t* m = S.meta + c[6] * SMOD_META;
        if (m[1] == 1 || m[1] == 2) {  // the common cases: branch-free, 32-bit (vectorized)
          const T* t = tab + m[0];
          const bool two = m[1] == 2;
          const int32_t n0 = int32_t(m[2]), n1 = two ? int32_t(m[3]) : 1;
          const int32_t s0 = int32_t(m[6]), s1 = two ? int32_t(m[7]) : 0;
          int32_t any = 0;
          if (two)
            any = gather2<true, T>(t, a, b, n0, n1, s0, s1, d, W);
          else
            any = gather2<false, T>(t, a, a, n0, 1, s0, 0, d, W);
          if (any) {  // which were read cells (a rare path)
            for (int64_t l = 0; l < W; ++l) {
              int32_t i0 = int32_t(a[l]), i1 = two ? int32_t(b[l]) : 0;
              i0 += i0 < 0 ? n0 : 0;
              i1 += i1 < 0 ? n1 : 0;
              if ((uint32_t(i0) >= uint32_t(n0) || uint32_t(i1) >= uint32_t(n1)) && read(l))
                __atomic_store_n(S.bad, 1, __ATOMIC_RELAXED);
            }
          }
          break;
        }
        for (int64_t l = 0; l < W; ++l) {
          bool oob = false;
          const int64_t f = smod_flat<T>(S, c, r, W, l, oob);
          if (oob && read(l)) __atomic_store_n(S.bad, 1, __ATOMIC_RELAXED);
          d[l] = tab[f];
        }
        break;
      }
      default: break;
    }
  }
}

// The reverse sweep over the instructions whose `varies` is `which`, on width W: adjoints g
// (per-key registers, width W) and ga (invariant registers, width NR: summed over the keys);
// live[e]: element e's seed is not 0 (only those add to the invariant sums and the tables'
// gradients, so that a blocked cell's 0 never meets an infinite derivative; the caller
// zeroes d score where the seed was 0). Each operand's share is one vectorizable loop.
template <typename T>
inline void smod_reverse(const ScoreProg& S, const T* r, T* g, T* ga, const uint8_t* varies,
                         int64_t W, int64_t which, const uint8_t* live, T* capg, T* tmp) {
  constexpr int nr = NR<T>;
  // tmp (the share of operand i) into i's adjoint
  auto acc = [&](int64_t i) {
    if (i < 0) return;
    if (varies[i]) {
      T* __restrict gi = g + i * W;
      for (int64_t l = 0; l < W; ++l) gi[l] += tmp[l];
    } else {
      T* gi = ga + i * nr;
      for (int64_t l = 0; l < W; ++l)
        if (which == 0 || live[l]) gi[l % nr] += tmp[l];
    }
  };
  for (int64_t k = S.n - 1; k >= 0; --k) {
    const int64_t* c = S.code + k * SMOD_COLS;
    if (c[7] != which) continue;
    const int64_t dst = c[1];
    const T* __restrict gd = varies[dst] ? g + dst * W : ga + dst * nr;
    const T* __restrict rd = r + dst * W;
    const T* __restrict a = c[2] >= 0 ? r + c[2] * W : nullptr;
    const T* __restrict b = c[3] >= 0 ? r + c[3] * W : nullptr;
    T* __restrict t = tmp;
#define CA_SHARE(I, EXPR)                                   \
  do {                                                      \
    for (int64_t l = 0; l < W; ++l) t[l] = (EXPR);          \
    acc(I);                                                 \
  } while (0)
    switch (c[0]) {
      case OP_ADD: CA_SHARE(c[2], gd[l]); CA_SHARE(c[3], gd[l]); break;
      case OP_SUB: CA_SHARE(c[2], gd[l]); CA_SHARE(c[3], -gd[l]); break;
      case OP_MUL: CA_SHARE(c[2], gd[l] * b[l]); CA_SHARE(c[3], gd[l] * a[l]); break;
      case OP_DIV: CA_SHARE(c[2], gd[l] / b[l]); CA_SHARE(c[3], -gd[l] * rd[l] / b[l]); break;
      case OP_NEG: CA_SHARE(c[2], -gd[l]); break;
      case OP_TANH: CA_SHARE(c[2], gd[l] * (T(1) - rd[l] * rd[l])); break;
      case OP_EXP: CA_SHARE(c[2], gd[l] * rd[l]); break;
      case OP_LOG: CA_SHARE(c[2], gd[l] / a[l]); break;
      case OP_ABS:
        CA_SHARE(c[2], a[l] > T(0) ? gd[l] : (a[l] < T(0) ? -gd[l] : T(0)));
        break;
      case OP_SQRT: CA_SHARE(c[2], gd[l] * T(0.5) / rd[l]); break;
      case OP_POW: {
        const T p = T(S.consts[c[6]]);
        if (p == T(2))
          CA_SHARE(c[2], gd[l] * T(2) * a[l]);
        else if (p != T(0))
          CA_SHARE(c[2], gd[l] * p * std::pow(a[l], p - T(1)));
        break;
      }
      case OP_SIN: CA_SHARE(c[2], gd[l] * std::cos(a[l])); break;
      case OP_COS: CA_SHARE(c[2], -gd[l] * std::sin(a[l])); break;
      case OP_WHERE:
        CA_SHARE(c[3], a[l] != T(0) ? gd[l] : T(0));
        CA_SHARE(c[4], a[l] != T(0) ? T(0) : gd[l]);
        break;
      case OP_SIGMOID: CA_SHARE(c[2], gd[l] * rd[l] * (T(1) - rd[l])); break;
      case OP_MAX:
        CA_SHARE(c[2], a[l] > b[l] ? gd[l] : (a[l] == b[l] ? gd[l] * T(0.5) : T(0)));
        CA_SHARE(c[3], b[l] > a[l] ? gd[l] : (a[l] == b[l] ? gd[l] * T(0.5) : T(0)));
        break;
      case OP_MIN:
        CA_SHARE(c[2], a[l] < b[l] ? gd[l] : (a[l] == b[l] ? gd[l] * T(0.5) : T(0)));
        CA_SHARE(c[3], b[l] < a[l] ? gd[l] : (a[l] == b[l] ? gd[l] * T(0.5) : T(0)));
        break;
      case OP_MOD:
        CA_SHARE(c[2], gd[l]);
        CA_SHARE(c[3], -gd[l] * std::floor(a[l] / b[l]));
        break;
      case OP_GATHER:
        if (capg && ((S.grad >> c[6]) & 1) && S.meta[c[6] * SMOD_META + 1] == 2) {
          const int64_t* m = S.meta + c[6] * SMOD_META;  // the two-axis case, 32-bit
          const int32_t n0 = int32_t(m[2]), n1 = int32_t(m[3]);
          const int32_t s0 = int32_t(m[6]), s1 = int32_t(m[7]);
          T* tg = capg + m[0];
          for (int64_t l = 0; l < W; ++l) {
            if (!(which == 0 || live[l]) || gd[l] == T(0)) continue;
            int32_t i0 = int32_t(a[l]), i1 = int32_t(b[l]);
            i0 += i0 < 0 ? n0 : 0;
            i1 += i1 < 0 ? n1 : 0;
            if (uint32_t(i0) < uint32_t(n0) && uint32_t(i1) < uint32_t(n1))
              tg[i0 * s0 + i1 * s1] += gd[l];
          }
        } else if (capg && ((S.grad >> c[6]) & 1))
          for (int64_t l = 0; l < W; ++l) {
            if (!(which == 0 || live[l]) || gd[l] == T(0)) continue;
            bool oob = false;
            const int64_t f = smod_flat<T>(S, c, r, W, l, oob);
            if (!oob) capg[f] += gd[l];
          }
        break;
      default: break;  // constants, comparisons, floor division: no gradient
    }
#undef CA_SHARE
  }
}

}  // namespace causalattn
