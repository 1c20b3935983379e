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

// One panel's registers and adjoints (NR lanes each), and which registers vary per key.
template <typename T>
struct SmodState {
  static constexpr int nr = NR<T>;
  std::vector<T> r, g, ga;  // values; per-key adjoints; invariant adjoints (panel sums)
  std::vector<uint8_t> varies;
  T* reg(int64_t i) { return r.data() + i * nr; }
};

template <typename T>
inline int64_t smod_flat(const ScoreProg& S, const int64_t* c, const T* r, int l, bool& oob) {
  const int64_t* m = S.meta + c[6] * SMOD_META;
  int64_t flat = m[0];
  for (int64_t d = 0; d < m[1]; ++d) {
    int64_t ix = int64_t(std::nearbyint(double(r[c[2 + d] * NR<T> + l])));
    if (ix < 0) ix += m[2 + d];  // torch's negative indices
    if (ix < 0 || ix >= m[2 + d]) {
      oob = true;
      ix = 0;
    }
    flat += ix * m[6 + d];
  }
  return flat;
}

// Run the instructions whose `varies` flag is `which` (0: once per panel, 1: per key) on
// lanes r; `valid` (bits per lane) says which lanes are read cells (index errors count there).
template <typename T>
inline void smod_run(const ScoreProg& S, T* r, int64_t which, uint64_t valid) {
  constexpr int nr = NR<T>;
  const T* tab = static_cast<const T*>(S.data);
  for (int64_t k = 0; k < S.n; ++k) {
    const int64_t* c = S.code + k * SMOD_COLS;
    if (c[7] != which) continue;
    T* d = r + c[1] * nr;
    const T* a = c[2] >= 0 ? r + c[2] * nr : nullptr;
    const T* b = c[3] >= 0 ? r + c[3] * nr : nullptr;
    const T* e = c[4] >= 0 ? r + c[4] * nr : nullptr;
    switch (c[0]) {
      case OP_CONST: for (int l = 0; l < nr; ++l) d[l] = T(S.consts[c[6]]); break;
      case OP_ADD: for (int l = 0; l < nr; ++l) d[l] = a[l] + b[l]; break;
      case OP_SUB: for (int l = 0; l < nr; ++l) d[l] = a[l] - b[l]; break;
      case OP_MUL: for (int l = 0; l < nr; ++l) d[l] = a[l] * b[l]; break;
      case OP_DIV: for (int l = 0; l < nr; ++l) d[l] = a[l] / b[l]; break;
      case OP_NEG: for (int l = 0; l < nr; ++l) d[l] = -a[l]; break;
      case OP_TANH:
        for (int l = 0; l < nr; l += Vec<T>::N) vstore(d + l, tanhv(vload(a + l)));
        break;
      case OP_EXP:
        for (int l = 0; l < nr; l += Vec<T>::N) vstore(d + l, exp2v(vload(a + l) * T(1.4426950408889634)));
        break;
      case OP_LOG: for (int l = 0; l < nr; ++l) d[l] = std::log(a[l]); break;
      case OP_ABS: for (int l = 0; l < nr; ++l) d[l] = a[l] < T(0) ? -a[l] : a[l]; break;
      case OP_SQRT: for (int l = 0; l < nr; ++l) d[l] = std::sqrt(a[l]); break;
      case OP_POW: {
        const T p = T(S.consts[c[6]]);
        if (p == T(2))
          for (int l = 0; l < nr; ++l) d[l] = a[l] * a[l];
        else
          for (int l = 0; l < nr; ++l) d[l] = std::pow(a[l], p);
        break;
      }
      case OP_SIN: for (int l = 0; l < nr; ++l) d[l] = std::sin(a[l]); break;
      case OP_COS: for (int l = 0; l < nr; ++l) d[l] = std::cos(a[l]); break;
      case OP_WHERE: for (int l = 0; l < nr; ++l) d[l] = a[l] != T(0) ? b[l] : e[l]; break;
      case OP_LT: for (int l = 0; l < nr; ++l) d[l] = T(a[l] < b[l]); break;
      case OP_LE: for (int l = 0; l < nr; ++l) d[l] = T(a[l] <= b[l]); break;
      case OP_GT: for (int l = 0; l < nr; ++l) d[l] = T(a[l] > b[l]); break;
      case OP_GE: for (int l = 0; l < nr; ++l) d[l] = T(a[l] >= b[l]); break;
      case OP_EQ: for (int l = 0; l < nr; ++l) d[l] = T(a[l] == b[l]); break;
      case OP_NE: for (int l = 0; l < nr; ++l) d[l] = T(a[l] != b[l]); break;
      case OP_AND: for (int l = 0; l < nr; ++l) d[l] = T(a[l] != T(0) && b[l] != T(0)); break;
      case OP_OR: for (int l = 0; l < nr; ++l) d[l] = T(a[l] != T(0) || b[l] != T(0)); break;
      case OP_NOT: for (int l = 0; l < nr; ++l) d[l] = T(a[l] == T(0)); break;
      case OP_SIGMOID: for (int l = 0; l < nr; ++l) d[l] = T(1) / (T(1) + std::exp(-a[l])); break;
      case OP_MAX: for (int l = 0; l < nr; ++l) d[l] = a[l] > b[l] ? a[l] : b[l]; break;
      case OP_MIN: for (int l = 0; l < nr; ++l) d[l] = a[l] < b[l] ? a[l] : b[l]; break;
      case OP_FLOORDIV: for (int l = 0; l < nr; ++l) d[l] = std::floor(a[l] / b[l]); break;
      case OP_MOD:
        for (int l = 0; l < nr; ++l) d[l] = a[l] - std::floor(a[l] / b[l]) * b[l];
        break;
      case OP_GATHER: {
        for (int l = 0; l < nr; ++l) {
          bool oob = false;
          const int64_t f = smod_flat<T>(S, c, r, l, oob);
          if (oob && ((valid >> l) & 1)) __atomic_store_n(S.bad, 1, __ATOMIC_RELAXED);
          d[l] = tab[f];
        }
        break;
      }
      default: break;
    }
  }
}

// The reverse sweep over the instructions whose `varies` is `which`, adjoints g (per-key
// registers) and ga (invariant registers: summed over the panel's keys); live: lanes whose
// seed is not 0 (only they add to the invariant sums and the tables' gradients, so that a
// blocked cell's 0 never meets an infinite derivative).
template <typename T>
inline void smod_reverse(const ScoreProg& S, SmodState<T>& st, int64_t which, const bool* live,
                         T* capg) {
  constexpr int nr = NR<T>;
  T* r = st.r.data();
  for (int64_t k = S.n - 1; k >= 0; --k) {
    const int64_t* c = S.code + k * SMOD_COLS;
    if (c[7] != which) continue;
    const int64_t dst = c[1];
    const T* gd = (st.varies[dst] ? st.g.data() : st.ga.data()) + dst * nr;
    const T* rd = r + dst * nr;
    const T* a = c[2] >= 0 ? r + c[2] * nr : nullptr;
    const T* b = c[3] >= 0 ? r + c[3] * nr : nullptr;
    // adjoint of register i: the per-key one, or the invariant sum (live lanes only)
    auto add = [&](int64_t i, int l, T v) {
      if (i < 0) return;
      if (st.varies[i])
        st.g[i * nr + l] += v;
      else if (which == 0 || live[l])
        st.ga[i * nr + l] += v;
    };
    for (int l = 0; l < nr; ++l) {
      const T g = gd[l];
      if (g == T(0)) continue;
      switch (c[0]) {
        case OP_ADD: add(c[2], l, g); add(c[3], l, g); break;
        case OP_SUB: add(c[2], l, g); add(c[3], l, -g); break;
        case OP_MUL: add(c[2], l, g * b[l]); add(c[3], l, g * a[l]); break;
        case OP_DIV: add(c[2], l, g / b[l]); add(c[3], l, -g * rd[l] / b[l]); break;
        case OP_NEG: add(c[2], l, -g); break;
        case OP_TANH: add(c[2], l, g * (T(1) - rd[l] * rd[l])); break;
        case OP_EXP: add(c[2], l, g * rd[l]); break;
        case OP_LOG: add(c[2], l, g / a[l]); break;
        case OP_ABS: add(c[2], l, a[l] > T(0) ? g : (a[l] < T(0) ? -g : T(0))); break;
        case OP_SQRT: add(c[2], l, g * T(0.5) / rd[l]); break;
        case OP_POW: {
          const T p = T(S.consts[c[6]]);
          if (p != T(0)) add(c[2], l, g * p * std::pow(a[l], p - T(1)));
          break;
        }
        case OP_SIN: add(c[2], l, g * std::cos(a[l])); break;
        case OP_COS: add(c[2], l, -g * std::sin(a[l])); break;
        case OP_WHERE:
          if (a[l] != T(0))
            add(c[3], l, g);
          else
            add(c[4], l, g);
          break;
        case OP_SIGMOID: add(c[2], l, g * rd[l] * (T(1) - rd[l])); break;
        case OP_MAX:
        case OP_MIN: {
          const bool first = c[0] == OP_MAX ? a[l] > b[l] : a[l] < b[l];
          if (a[l] == b[l]) {
            add(c[2], l, g * T(0.5));
            add(c[3], l, g * T(0.5));
          } else {
            add(first ? c[2] : c[3], l, g);
          }
          break;
        }
        case OP_MOD: add(c[2], l, g); add(c[3], l, -g * std::floor(a[l] / b[l])); break;
        case OP_GATHER:
          if (capg && ((S.grad >> c[6]) & 1) && (which == 0 || live[l])) {
            bool oob = false;
            const int64_t f = smod_flat<T>(S, c, r, l, oob);
            if (!oob) capg[f] += g;
          }
          break;
        default: break;  // constants, comparisons, floor division: no gradient
      }
    }
  }
}

}  // namespace causalattn
