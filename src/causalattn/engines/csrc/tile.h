// The pieces the forward and the backward share on a transposed score tile Sᵀ (keys as rows,
// queries as columns, NR query columns per panel): per-column data of the queries, and the
// step that turns one key row of raw base-2 scores into modified, masked scores. Keeping
// queries along the vector lanes makes the softmax's row statistics elementwise (no
// horizontal reductions, no ragged tails) and lets K and V be read in place as GEMM rows.
#pragma once

#include "problem.h"

namespace causalattn {

// The query columns of a tile: for each column its batch row's data, head, position and
// interval, and per NR-column panel the hull of its intervals. Padding columns (beyond n)
// read nothing.
template <typename T>
struct Cols {
  int64_t n = 0, ld = 0;  // real columns, columns padded to whole panels
  std::vector<T> lo, hi, pos, slope;
  std::vector<uint32_t> rk;  // dropout row keys
  std::vector<int64_t> head, i;
  std::vector<int64_t> plo, phi, maxlo, minhi;  // per panel, over its real columns
  // offsets to add j to: bias (boff), the reversed rel_bias rows (roff: minus j), d bias
  // (zoff, set by the backward);
  // per panel whether its real columns are one head at consecutive positions (one vector)
  std::vector<int64_t> boff, roff, zoff;
  std::vector<uint8_t> runi;
  int64_t klo = 0, khi = 0;  // the hull of every column's interval

  // columns c = 0..n-1 are (head[c], i[c]) of batch row b
  void build(const Problem& P, int64_t b) {
    ld = round_up<T>(n);
    lo.assign(ld, T(0));
    hi.assign(ld, T(0));
    pos.assign(ld, T(0));
    slope.assign(ld, T(0));
    rk.assign(ld, 0u);
    const int64_t np = ld / NR<T>;
    plo.assign(np, P.Tk);
    phi.assign(np, 0);
    maxlo.assign(np, 0);
    minhi.assign(np, P.Tk);
    klo = P.Tk;
    khi = 0;
    const int64_t *L = P.lo_row(b), *H = P.hi_row(b);
    for (int64_t c = 0; c < n; ++c) {
      const int64_t lo_c = L[i[c]], hi_c = H[i[c]], p = c / NR<T>;
      lo[c] = T(lo_c);
      hi[c] = T(hi_c);
      pos[c] = T(P.q_start + i[c]);
      if (P.slopes) slope[c] = T(P.slopes[b * P.slopes_b + head[c]] * LOG2E);
      if (P.dropout) rk[c] = row_key(head_key(P.seed, P.offset, b, head[c]), P.q_start + i[c]);
      maxlo[p] = std::max(maxlo[p], lo_c);
      minhi[p] = std::min(minhi[p], hi_c);
      if (lo_c < hi_c) {
        plo[p] = std::min(plo[p], lo_c);
        phi[p] = std::max(phi[p], hi_c);
        klo = std::min(klo, lo_c);
        khi = std::max(khi, hi_c);
      }
    }
    for (int64_t c = n; c < ld; ++c) {  // padding columns: an empty interval
      lo[c] = T(P.Tk);
      hi[c] = T(0);
    }
    if (P.bias || P.rel) offsets(P, b);
  }

  void offsets(const Problem& P, int64_t b) {
    boff.assign(ld, 0);
    roff.assign(ld, 0);
    runi.assign(ld / NR<T>, 1);
    const int64_t R = P.rel_ld - 2 * REL_PAD, ctr = (R - 1) / 2;
    for (int64_t c = 0; c < n; ++c) {
      const int64_t h = head[c], pos_c = P.q_start + i[c];
      boff[c] = b * P.bias_s[0] + h * P.bias_s[1] + i[c] * P.bias_s[2];
      // reversed index of rel column ctr + (k_start + j) - pos: (R - 1) - that + REL_PAD
      roff[c] = h * P.rel_ld + REL_PAD + (R - 1) - ctr - P.k_start + pos_c;
      if (c % NR<T> && (head[c] != head[c - 1] || i[c] != i[c - 1] + 1)) runi[c / NR<T>] = 0;
    }
  }
  int64_t panels() const { return ld / NR<T>; }
  // whether panel p reads key j at all
  bool reads(int64_t p, int64_t j) const { return j >= plo[p] && j < phi[p]; }
};

// The tile's kinds for the heads of its columns (from the kinds grid), and whether the tile
// needs per-cell mask reads beyond the intervals.
struct TileKinds {
  std::vector<int32_t> of_head;  // indexed by head - h0
  int64_t h0 = 0;
  bool any_read = false, partial = false;
  void build(const Problem& P, int64_t b, int64_t h0_, int64_t nh, int64_t qb, int64_t kb) {
    h0 = h0_;
    of_head.resize(nh);
    any_read = false;
    partial = false;
    for (int64_t h = 0; h < nh; ++h) {
      const int32_t k = P.kind(b, h0 + h, qb, kb);
      of_head[h] = k;
      any_read |= k != SKIP;
      partial |= k != FULL;
    }
  }
};

// The modifiers and M for the NR columns of panel p, hoisted out of the key loop: one key
// row j at a time, softcap, ALiBi, then the intervals (elementwise compares) and, where
// the tile is partial, the dense or tile mask (a rare path, not inlined). Columns that may
// not read j become -inf. With `th`, tanh(S/c) is kept there (the backward's d tanh).
template <typename T>
struct PanelMods {
  using V = typename Vec<T>::v;
  static constexpr int N = Vec<T>::N;
  const Problem& P;
  const Cols<T>& cols;
  const TileKinds& tk;
  int64_t b, c0;
  T cap2;
  bool intervals, alibi, adds;
  V lo[2], hi[2], pos[2], slope[2];
  const T* bt;  // the bias of keys [bc, ...) for these columns, [j - bc][NR] (bias_block)
  int64_t bc;
  SmodState<T>* sm = nullptr;  // the score_mod's registers for this panel (thread's own)
  uint64_t real = 0;  // lanes that are real columns
  bool block = false;  // the score_mod runs on key blocks (smod_block), not in apply

  PanelMods(const Problem& P_, const Cols<T>& cols_, const TileKinds& tk_, int64_t b_,
            int64_t p, bool need_intervals, T cap2_, const T* bt_ = nullptr, int64_t bc_ = 0)
      : P(P_), cols(cols_), tk(tk_), b(b_), c0(p * NR<T>), cap2(cap2_),
        intervals(need_intervals), alibi(P_.slopes != nullptr),
        adds(P_.bias != nullptr || P_.rel != nullptr), bt(bt_), bc(bc_) {
    for (int h = 0; h < 2; ++h) {
      lo[h] = vload(cols.lo.data() + c0 + h * N);
      hi[h] = vload(cols.hi.data() + c0 + h * N);
      pos[h] = vload(cols.pos.data() + c0 + h * N);
      slope[h] = vload(cols.slope.data() + c0 + h * N);
    }
    if (P.smod.on()) smod_setup();
  }

  static SmodState<T>& smod_state() {
    thread_local SmodState<T> s;
    return s;
  }

  // the panel's registers: b, h, q_idx per lane, then the invariant instructions
  __attribute__((noinline)) void smod_setup() {
    const ScoreProg& S = P.smod;
    constexpr int nr = NR<T>;
    sm = &smod_state();
    sm->r.assign(size_t(S.regs * nr), T(0));
    sm->g.assign(size_t(S.regs * nr), T(0));
    sm->ga.assign(size_t(S.regs * nr), T(0));
    sm->tmp.assign(size_t(SmodState<T>::CH * nr), T(0));
    sm->varies.assign(size_t(S.regs), 0);
    sm->varies[0] = sm->varies[4] = 1;
    for (int64_t k = 0; k < S.n; ++k)
      sm->varies[S.code[k * SMOD_COLS + 1]] = uint8_t(S.code[k * SMOD_COLS + 7]);
    T* r = sm->r.data();
    for (int l = 0; l < nr; ++l) {
      const int64_t c = c0 + l;
      const bool ok = c < cols.n;
      if (ok) real |= uint64_t(1) << l;
      r[1 * nr + l] = T(b);
      r[2 * nr + l] = ok ? T(cols.head[c]) : T(0);
      r[3 * nr + l] = cols.pos[c];
    }
    smod_run<T>(S, r, nr, 0, [&](int64_t l) { return bool((real >> l) & 1); });
    block = !(cap2 != T(0)) && !alibi && !adds;  // nothing before it: whole key blocks
    if (block) {  // the invariant registers copied to every row of a key block
      constexpr int64_t W = SmodState<T>::CH * nr;
      sm->rb.assign(size_t(S.regs * W), T(0));
      sm->gb.assign(size_t(S.regs * W), T(0));
      sm->live.assign(size_t(W), 0);
      for (int64_t i = 0; i < S.regs; ++i)
        if (!sm->varies[i])
          for (int64_t row = 0; row < SmodState<T>::CH; ++row)
            std::copy_n(r + i * nr, nr, sm->rb.data() + i * W + row * nr);
    }
  }

  // whether lane l of key row j is a read cell (a real column, j inside its interval)
  bool reads_cell(int64_t l, int64_t j) const {
    return ((real >> l) & 1) && T(j) >= cols.lo[c0 + l] && T(j) < cols.hi[c0 + l];
  }

  // the score_mod on key row j's NR base-2 scores x, in place (natural units inside)
  __attribute__((noinline)) void smod_cells(int64_t j, T* x) const {
    const ScoreProg& S = P.smod;
    constexpr int nr = NR<T>;
    T* r = sm->r.data();
    const T kv = T(P.k_start + j);
    for (int l = 0; l < nr; ++l) {
      r[l] = x[l] * T(LN2);
      r[4 * nr + l] = kv;
    }
    smod_run<T>(S, r, nr, 1, [&](int64_t l) { return reads_cell(l, j); });
    const T* o = r + S.out * nr;
    for (int l = 0; l < nr; ++l) x[l] = o[l] * T(LOG2E);
  }

  // The block path (no modifier before the score_mod): rows [j0, j1) of the panel's base-2
  // scores x (row stride ld), CH rows at a time; with ds (row stride ldd), the reverse
  // sweep: ds (d output) becomes d score in place, the tables' gradients into capg.
  __attribute__((noinline)) void smod_block(T* x, int64_t ld, int64_t j0, int64_t j1,
                                            T* ds = nullptr, int64_t ldd = 0,
                                            T* capg = nullptr) const {
    const ScoreProg& S = P.smod;
    constexpr int nr = NR<T>, CH = SmodState<T>::CH;
    constexpr int64_t W = CH * nr;
    T* r = sm->rb.data();
    for (int64_t a = j0; a < j1; a += CH) {
      const int64_t rows = std::min<int64_t>(CH, j1 - a);
      for (int64_t row = 0; row < CH; ++row) {  // rows past j1 repeat the last one
        const int64_t jr = a + std::min<int64_t>(row, rows - 1);
        const T* xr = x + (jr - j0) * ld;
        const T kv = T(P.k_start + jr);
        for (int l = 0; l < nr; ++l) {
          r[row * nr + l] = xr[l] * T(LN2);
          r[4 * W + row * nr + l] = kv;
        }
      }
      smod_run<T>(S, r, W, 1, [&](int64_t e) {
        return e / nr < rows && reads_cell(e % nr, a + e / nr);
      });
      if (!ds) {
        const T* o = r + S.out * W;
        for (int64_t row = 0; row < rows; ++row)
          for (int l = 0; l < nr; ++l) x[(a + row - j0) * ld + l] = o[row * nr + l] * T(LOG2E);
        continue;
      }
      T* g = sm->gb.data();
      uint8_t* live = sm->live.data();
      for (int64_t i = 0; i < S.regs; ++i)
        if (sm->varies[i]) std::fill_n(g + i * W, W, T(0));
      for (int64_t row = 0; row < CH; ++row)
        for (int l = 0; l < nr; ++l) {
          const T v = row < rows ? ds[(a + row - j0) * ldd + l] : T(0);
          live[row * nr + l] = v != T(0);
          if (sm->varies[S.out])
            g[S.out * W + row * nr + l] = v;
          else if (v != T(0))
            sm->ga[S.out * nr + l] += v;
        }
      smod_reverse<T>(S, r, g, sm->ga.data(), sm->varies.data(), W, 1, live, capg,
                      sm->tmp.data());
      // d score where the seed was not 0, tested on ds again (the sweep leaves it), not
      // on live: as a select on live's uint8_t lanes, GCC 12 (-O3, AVX2) gave the second
      // vector of each panel wrong values (seen on an AVX2 machine; AVX-512 and SSE right)
      for (int64_t row = 0; row < rows; ++row)
        for (int l = 0; l < nr; ++l) {
          T* d = ds + (a + row - j0) * ldd + l;
          *d = *d != T(0) ? g[row * nr + l] : T(0);
        }
    }
  }

  // d score of key row j in place from ds = d output (natural units), right after apply(j):
  // the registers still hold row j's values; the captured tensors' gradients into capg
  __attribute__((noinline)) void smod_vjp(T* ds, T* capg) const {
    const ScoreProg& S = P.smod;
    constexpr int nr = NR<T>;
    uint8_t live[nr];
    for (int64_t i = 0; i < S.regs; ++i)
      if (sm->varies[i]) std::fill_n(sm->g.data() + i * nr, nr, T(0));
    for (int l = 0; l < nr; ++l) live[l] = ds[l] != T(0);
    if (sm->varies[S.out]) {
      std::copy_n(ds, nr, sm->g.data() + S.out * nr);
    } else {
      for (int l = 0; l < nr; ++l)
        if (live[l]) sm->ga[S.out * nr + l] += ds[l];
    }
    smod_reverse<T>(S, sm->r.data(), sm->g.data(), sm->ga.data(), sm->varies.data(), nr, 1,
                    live, capg, sm->tmp.data());
    for (int l = 0; l < nr; ++l) ds[l] = ds[l] != T(0) ? sm->g[l] : T(0);  // (as smod_block)
  }

  // after the panel's keys: the invariant instructions' reverse sweep (their adjoints
  // summed over the keys)
  void smod_finish(T* capg) const {
    if (sm)
      smod_reverse<T>(P.smod, sm->r.data(), sm->g.data(), sm->ga.data(), sm->varies.data(),
                      NR<T>, 0, nullptr, capg, sm->tmp.data());
  }

  // fn.template operator()<CAP, ALIBI, INTERVALS>() for this panel's combination
  template <typename F>
  void dispatch(F&& fn) const {
    const bool cap = cap2 != T(0);
    if (cap) {
      if (alibi)
        intervals ? fn.template operator()<true, true, true>()
                  : fn.template operator()<true, true, false>();
      else
        intervals ? fn.template operator()<true, false, true>()
                  : fn.template operator()<true, false, false>();
    } else {
      if (alibi)
        intervals ? fn.template operator()<false, true, true>()
                  : fn.template operator()<false, true, false>();
      else
        intervals ? fn.template operator()<false, false, true>()
                  : fn.template operator()<false, false, false>();
    }
  }

  // apply<CAP, ALIBI, INTERVALS>: the same with the modifiers known at compile time (the
  // per-panel loops are instantiated per combination: fewer live registers, no spills)
  template <bool CAP, bool ALIBI, bool INTERVALS>
  __attribute__((always_inline)) inline void apply(int64_t j, T* x, T* th) const {
    if constexpr (!CAP && !ALIBI && !INTERVALS) {  // a full tile without modifiers
      if (adds) add_cells(j, x);
      if (sm && !block) smod_cells(j, x);
      if (tk.partial) mask_cells(j, x);
      return;
    }
    V s[2] = {vload(x), vload(x + N)};
    if (CAP) {
      for (int h = 0; h < 2; ++h) {
        const V t = tanhv(s[h]);
        if (th) vstore(th + h * N, t);
        s[h] = t * cap2;
      }
    }
    if (ALIBI) {
      const T kpos = T(P.k_start + j);
      for (int h = 0; h < 2; ++h) {
        V d = pos[h] - kpos;
        d = d < T(0) ? -d : d;
        s[h] -= slope[h] * d;
      }
    }
    if (adds) {  // rel_bias, bias: through memory (a rare path, not inlined)
      vstore(x, s[0]);
      vstore(x + N, s[1]);
      add_cells(j, x);
      s[0] = vload(x);
      s[1] = vload(x + N);
    }
    if (sm && !block) {  // the score_mod: through memory (its own, not inlined)
      vstore(x, s[0]);
      vstore(x + N, s[1]);
      smod_cells(j, x);
      s[0] = vload(x);
      s[1] = vload(x + N);
    }
    if (INTERVALS) {
      const T jf = T(j);
      const V ninf = vset<T>(-std::numeric_limits<T>::infinity());
      for (int h = 0; h < 2; ++h) s[h] = ((jf < lo[h]) | (jf >= hi[h])) ? ninf : s[h];
    }
    vstore(x, s[0]);
    vstore(x + N, s[1]);
    if (tk.partial) mask_cells(j, x);
  }

  // + rel_bias (one vector where the panel is uniform) + bias·log2 e, for key row j
  __attribute__((noinline)) void add_cells(int64_t j, T* x) const {
    const int64_t n = std::min<int64_t>(cols.n - c0, NR<T>);
    if (P.rel) {
      const T* rel = static_cast<const T*>(P.rel);
      if (cols.runi[c0 / NR<T>]) {
        const T* r = rel + cols.roff[c0] - j;
        vstore(x, vload(x) + vload(r));
        vstore(x + N, vload(x + N) + vload(r + N));
      } else {
        for (int64_t c = 0; c < n; ++c) x[c] += rel[cols.roff[c0 + c] - j];
      }
    }
    if (P.bias) {
      const T* r = bt + (j - bc) * NR<T>;
      vstore(x, vload(x) + vload(r));
      vstore(x + N, vload(x + N) + vload(r + N));
    }
  }

  __attribute__((noinline)) void mask_cells(int64_t j, T* x) const {
    for (int64_t c = c0; c < std::min(cols.n, c0 + NR<T>); ++c) {
      const int32_t kind = tk.of_head[cols.head[c] - tk.h0];
      if (kind != FULL && !P.allowed(b, cols.head[c], cols.i[c], j, kind))
        x[c - c0] = -std::numeric_limits<T>::infinity();
    }
  }
};

// The bias of panel p's columns for keys [c, ce), ·log2 e, transposed to [j - c][NR] (zero
// in padding columns): each column's row is read contiguously (reading a key row across
// the columns would step T_k values at a time, one cache set for every column).
template <typename T>
void bias_block(const Problem& P, const Cols<T>& cols, int64_t p, int64_t c, int64_t ce,
                T* bt) {
  const int64_t c0 = p * NR<T>, s3 = P.bias_s[3];
  const T* bias = static_cast<const T*>(P.bias);
  for (int64_t lane = 0; lane < NR<T>; ++lane) {
    if (c0 + lane >= cols.n) {
      for (int64_t j = c; j < ce; ++j) bt[(j - c) * NR<T> + lane] = T(0);
      continue;
    }
    const T* row = bias + cols.boff[c0 + lane];
    for (int64_t j = c; j < ce; ++j) bt[(j - c) * NR<T> + lane] = row[j * s3] * T(LOG2E);
  }
}

// P[c] = 0 where the dropout hash of (row key rk[c], column key ck) says dropped, NR columns.
template <typename T>
inline void drop_cols(T* x, const uint32_t* rk, uint32_t ck, uint32_t thr) {
  if constexpr (sizeof(T) == 4 && Vec<T>::N * 4 == VBYTES) {
    for (int h = 0; h < 2; ++h) {
      vu32 k;
      std::memcpy(&k, rk + h * Vec<T>::N, sizeof(k));
      k ^= ck;
      k ^= k >> 16;
      k *= HASH_C1;
      k ^= k >> 13;
      k *= HASH_C2;
      k ^= k >> 16;
      typename Vec<T>::v y = vload(x + h * Vec<T>::N);
      y = (k >> 8) < thr ? typename Vec<T>::v{} : y;
      vstore(x + h * Vec<T>::N, y);
    }
  } else {
    for (int c = 0; c < NR<T>; ++c)
      if ((fmix32(rk[c] ^ ck) >> 8) < thr) x[c] = T(0);
  }
}

}  // namespace causalattn
