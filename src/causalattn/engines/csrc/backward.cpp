// The backward pass by recomputation (FlashAttention-2). Per (batch row, kv head, lane): the
// lane's key blocks in a fixed order; for each, the query chunks that read it: Sᵀ = K Qᵀ and
// dPᵀ = V dOᵀ (transposed tiles, queries along the lanes), P from the given lse,
// dS = P ∘ (dP − D) fused, then dV += P dO, dK += dS Q and dQ += dSᵀ K. Each task owns its
// dK, dV blocks; dQ is summed over a fixed number of lanes in lane order: no atomics, and
// the same bits whatever the thread count.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "tile.h"

namespace causalattn {
namespace {

template <typename T>
constexpr T NEG_INF = -std::numeric_limits<T>::infinity();

// One kv head's operands, packed (see Backward::pack_rows): Qp, dOp [query panel][x][NR]
// (B operands of Sᵀ = K Qᵀ, dPᵀ = V dOᵀ; the values as given); Qn, dOn [x panel][row][NR]
// (B operands of dK += dS Q, dV += P dO; non-finite values zeroed, their rows marked in
// qbad, dobad); K, V in MR-key panels [key / MR][x][key % MR] (A operands of Sᵀ and dPᵀ,
// kr, vr, zero keys past T_k); Kn [x panel][key][NR] (B of dQ += dSᵀ K; zeroed, marked in
// kbad).
template <typename T>
struct Packed {
  T *qp, *qn, *dop, *don, *kr, *vr, *kn;
  uint8_t *qbad, *dobad, *kbad;
};

template <typename T>
struct BWork {  // a thread's buffers, reused across tasks and calls
  std::vector<T> qp_b, qn_b, dop_b, don_b, kr_b, vr_b, kn_b, st, dpt, th, dk, dv, dq, slc, bt, gzt, xs;
  std::vector<uint8_t> qbad_b, dobad_b, kbad_b;
  Packed<T> pk;  // the task's head (thread-local buffers, or the call's shared ones)
  std::vector<Cols<T>> chunks;
  std::vector<int64_t> rlo, rhi;
  TileKinds tk;
  T *racc = nullptr, *sacc = nullptr;  // the task's d rel_bias (g, rel_ld), d slopes (g)
  T* dz = nullptr;                     // the task's part of d bias
  T* capacc = nullptr;  // the task's gradients of the score_mod's tables (null: none wanted)
};

template <typename I, typename T>
struct Backward {
  using V = typename Vec<T>::v;
  static constexpr int N = Vec<T>::N;
  static constexpr int nr = NR<T>;
  static constexpr int64_t KC = 256;  // K-blocking of the score GEMMs (large head sizes)

  const Problem& P;
  int64_t bkb, bqb, lanes;
  int64_t Tpad, Tqp, dkp, dvp, Rq;  // Rq = g·Tqp stacked query rows (heads padded to panels)
  T alpha, cap2, zscale;
  View4<I> Q, K, Vv, dO;
  const T* D;     // (B, Hq, Tqp): rowsum(dO ∘ O) − dlse, 0 on padding rows
  const T* lse2;  // (B, Hq, Tqp): lse·log2 e, +inf where no key is readable
  std::vector<uint32_t> colkeys;
  I *dq_out, *dk_out, *dv_out;
  T* dq_lanes = nullptr;  // (B·Hkv, lanes, Rq, dkp) when lanes > 1
  T* shared = nullptr;  // every head's packed operands when lanes > 1 (see views())
  int64_t want = 0;       // WANT_* bits
  // d bias when WANT_BIAS: (parts, bias's 4-D shape); a task adds its dZ at b·zs0 + h·zs1 +
  // i·zs2 + j·zs3 of its part (strides 0 on bias's broadcast axes), in its fixed order
  T* dz_out = nullptr;
  int64_t zs[4] = {0, 0, 0, 0}, zpart = 0;  // strides, elements per part
  bool zsplit_h = false, zsplit_l = false;  // a part per kv head, per lane
  T* racc_all = nullptr;  // (tasks, g, rel_ld) d rel_bias per task, reversed rows
  T* sacc_all = nullptr;  // (tasks, g) d slopes per task
  T* cap_all = nullptr;   // (tasks, tables' elements) the score_mod's table gradients
  uint8_t* shared_flags = nullptr;

  Backward(const Problem& p, int64_t bkb_, int64_t bqb_, int64_t lanes_, const at::Tensor& dout,
           const T* D_, const T* lse2_, I* dq, I* dk, I* dv)
      : P(p), bkb(bkb_), bqb(bqb_), lanes(lanes_), Q(p.q), K(p.k), Vv(p.v), dO(dout), D(D_),
        lse2(lse2_), dq_out(dq), dk_out(dk), dv_out(dv) {
    Tpad = round_up<T>(P.Tk);
    Tqp = round_up<T>(P.Tq);
    dkp = round_up<T>(P.dk);
    dvp = round_up<T>(P.dv);
    Rq = P.g * Tqp;
    if (P.softcap > 0) {
      alpha = T(P.scale / P.softcap);
      cap2 = T(P.softcap * LOG2E);
    } else {
      alpha = T(P.scale * LOG2E);
      cap2 = T(0);
    }
    zscale = P.dropout ? T(P.drop_scale) : T(1);
    if (P.dropout) {
      colkeys.resize(P.Tk);
      for (int64_t j = 0; j < P.Tk; ++j) colkeys[j] = col_key(P.k_start + j);
    }
  }

  // sizes of one head's packed operands, in elements
  int64_t q_elems() const { return Rq * (P.dk + dkp + P.dv + dvp); }
  int64_t k_elems() const { return kpad() * (P.dk + P.dv) + dkp * Tpad; }
  int64_t kpad() const { return (P.Tk + MR - 1) / MR * MR; }  // keys in whole MR-panels
  // element (j, x) of a key-panel layout of width d
  static int64_t kat(int64_t j, int64_t x, int64_t d) { return (j / MR * d + x) * MR + j % MR; }

  // Packed views of a buffer of q_elems() + k_elems() values and Rq·2 + Tk flags
  Packed<T> views(T* buf, uint8_t* flags) const {
    Packed<T> k;
    k.qp = buf;
    k.qn = k.qp + Rq * P.dk;
    k.dop = k.qn + dkp * Rq;
    k.don = k.dop + Rq * P.dv;
    k.kr = k.don + dvp * Rq;
    k.vr = k.kr + kpad() * P.dk;
    k.kn = k.vr + kpad() * P.dv;
    k.qbad = flags;
    k.dobad = flags + Rq;
    k.kbad = flags + 2 * Rq;
    return k;
  }

  // one row of x (d values, scaled by f) into a row buffer; whether one is not finite
  template <typename X>
  static bool load_row(const X* src, int64_t s3, int64_t d, T f, T* dst) {
    bool bad = false;
    for (int64_t x = 0; x < d; ++x) {
      dst[x] = T(src[x * s3]) * f;
      bad |= !std::isfinite(dst[x]);
    }
    return bad;
  }

  // a row r (of n_rows) into both layouts: [r / NR][x][r % NR] and, zeroed where not
  // finite, [x / NR][r][x % NR]
  static void scatter_row(const T* y, int64_t d, int64_t dpad, int64_t r, int64_t n_rows,
                          bool bad, T* panels, T* rows) {
    T* pd = panels + (r / nr) * d * nr + r % nr;
    for (int64_t x = 0; x < d; ++x) pd[x * nr] = y[x];
    for (int64_t x0 = 0; x0 < dpad; x0 += nr) {
      T* rd = rows + ((x0 / nr) * n_rows + r) * nr;
      for (int64_t n = 0; n < nr; ++n) {
        const int64_t x = x0 + n;
        const T v = x < d ? y[x] : T(0);
        rd[n] = (bad && !std::isfinite(v)) ? T(0) : v;
      }
    }
  }

  // Pack stacked query rows [r0, r1) and keys [j0, j1) of (b, kv head) into `k`.
  void pack_rows(int64_t b, int64_t hkv, int64_t r0, int64_t r1, int64_t j0, int64_t j1,
                 const Packed<T>& k) const {
    std::vector<T> y(std::max(std::max(P.dk, P.dv), int64_t(1)));
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t q = r / Tqp, i = r % Tqp, h = hkv * P.g + q;
      bool qb = false, gb = false;
      if (i < P.Tq) {
        qb = load_row(Q.row(b, h, i), Q.s3, P.dk, alpha, y.data());
      } else {
        std::fill(y.begin(), y.end(), T(0));
      }
      scatter_row(y.data(), P.dk, dkp, r, Rq, qb, k.qp, k.qn);
      if (i < P.Tq) {
        gb = load_row(dO.row(b, h, i), dO.s3, P.dv, zscale, y.data());
      } else {
        std::fill(y.begin(), y.end(), T(0));
      }
      scatter_row(y.data(), P.dv, dvp, r, Rq, gb, k.dop, k.don);
      k.qbad[r] = qb;
      k.dobad[r] = gb;
    }
    std::vector<T> yk(std::max(P.dk, int64_t(1)));
    for (int64_t j = j0; j < j1; ++j) {
      const I* ks = K.row(b, hkv, j);
      const I* vs = Vv.row(b, hkv, j);
      for (int64_t x = 0; x < P.dv; ++x) k.vr[kat(j, x, P.dv)] = T(vs[x * Vv.s3]);
      const bool bad = load_row(ks, K.s3, P.dk, T(1), yk.data());
      for (int64_t x = 0; x < P.dk; ++x) k.kr[kat(j, x, P.dk)] = yk[x];
      k.kbad[j] = bad;
      for (int64_t x0 = 0; x0 < dkp; x0 += nr) {  // Kn: [x / NR][j][x % NR], zeroed
        T* kd = k.kn + ((x0 / nr) * Tpad + j) * nr;
        for (int64_t n = 0; n < nr; ++n) {
          const int64_t x = x0 + n;
          const T v = x < P.dk ? yk[x] : T(0);
          kd[n] = (bad && !std::isfinite(v)) ? T(0) : v;
        }
      }
    }
    if (j1 == P.Tk) {  // the padding keys of the last panels
      for (int64_t j = P.Tk; j < Tpad; ++j)
        for (int64_t x0 = 0; x0 < dkp; x0 += nr)
          std::fill_n(k.kn + ((x0 / nr) * Tpad + j) * nr, nr, T(0));
      for (int64_t j = P.Tk; j < kpad(); ++j) {
        for (int64_t x = 0; x < P.dk; ++x) k.kr[kat(j, x, P.dk)] = T(0);
        for (int64_t x = 0; x < P.dv; ++x) k.vr[kat(j, x, P.dv)] = T(0);
      }
    }
  }

  // the task's own copy of its head's operands (one lane: nothing to share)
  void pack(int64_t b, int64_t hkv, BWork<T>& w) const {
    T* buf = scratch(w.qp_b, size_t(q_elems() + k_elems()));
    uint8_t* flags = scratch(w.qbad_b, size_t(2 * Rq + P.Tk));
    w.pk = views(buf, flags);
    pack_rows(b, hkv, 0, Rq, 0, P.Tk, w.pk);
  }

  // the fixed query chunks of a head: bqb rows from multiples of bqb (on the kinds grid)
  void chunks(int64_t b, int64_t hkv, BWork<T>& w) const {
    const int64_t per_head = (P.Tq + bqb - 1) / bqb;
    w.chunks.resize(P.g * per_head);
    for (int64_t q = 0; q < P.g; ++q) {
      for (int64_t t = 0; t < per_head; ++t) {
        Cols<T>& cols = w.chunks[q * per_head + t];
        const int64_t a = t * bqb, a2 = std::min(P.Tq, a + bqb);
        cols.n = a2 - a;
        cols.head.assign(cols.n, hkv * P.g + q);
        cols.i.resize(cols.n);
        for (int64_t c = 0; c < cols.n; ++c) cols.i[c] = a + c;
        cols.build(P, b);
        if (want & WANT_BIAS) {  // d bias cells of the columns (its broadcast axes: stride 0)
          cols.zoff.assign(cols.ld, 0);
          for (int64_t cc = 0; cc < cols.n; ++cc)
            cols.zoff[cc] = b * zs[0] + cols.head[cc] * zs[1] + cols.i[cc] * zs[2];
        }
      }
    }
  }

  // one (key block [c, ce), query chunk) step
  void step(int64_t b, int64_t hkv, int64_t q, int64_t a, const Cols<T>& cols, int64_t c,
            int64_t ce, BWork<T>& w, T* dKacc, T* dVacc, T* dQacc) const {
    const int64_t n = cols.n, ld = cols.ld, np = cols.panels(), wk = ce - c;
    const int64_t h = hkv * P.g + q;
    const int64_t r0 = q * Tqp + a;  // the chunk's first stacked row (a whole panel)
    w.tk.build(P, b, h, 1, a / P.bq, c / P.bk);
    if (!w.tk.any_read) return;
    T* st = scratch(w.st, size_t(bkb * ld));
    if (want & WANT_SLOPES) w.slc.assign(ld, T(0));
    T* dpt = scratch(w.dpt, size_t(bkb * ld));
    T* th = cap2 != T(0) ? scratch(w.th, size_t(bkb * ld)) : nullptr;
    const T* kr = w.pk.kr;
    const T* vr = w.pk.vr;
    // Sᵀ = K Qᵀ, dPᵀ = V dOᵀ for the key rows some column of a panel reads (K-blocked: a
    // wide head's panel of Q would not stay in L1)
    for (int64_t p = 0; p < np; ++p) {
      const int64_t j_lo = std::max(c, cols.plo[p]), j_hi = std::min(ce, cols.phi[p]);
      const T* bq_ = w.pk.qp + (r0 / nr + p) * P.dk * nr;
      const T* bo_ = w.pk.dop + (r0 / nr + p) * P.dv * nr;
      for (int64_t k0 = 0; k0 < std::max(P.dk, P.dv); k0 += KC) {
        for (int64_t j0 = j_lo / MR * MR; j0 < j_hi; j0 += MR) {  // whole MR-key panels
          T* cs = st + (j0 - c) * ld + p * nr;
          T* cd = dpt + (j0 - c) * ld + p * nr;
          if (k0 < P.dk) {
            const int64_t kc = std::min(KC, P.dk - k0);
            const T* A = kr + kat(j0, k0, P.dk);
            if (k0 == 0)
              micro<MR, false>(kc, A, 1, MR, bq_ + k0 * nr, nr, cs, ld);
            else
              micro<MR, true>(kc, A, 1, MR, bq_ + k0 * nr, nr, cs, ld);
          }
          if (k0 < P.dv) {
            const int64_t kc = std::min(KC, P.dv - k0);
            const T* A = vr + kat(j0, k0, P.dv);
            if (k0 == 0)
              micro<MR, false>(kc, A, 1, MR, bo_ + k0 * nr, nr, cd, ld);
            else
              micro<MR, true>(kc, A, 1, MR, bo_ + k0 * nr, nr, cd, ld);
          }
        }
      }
    }
    // the vertical pass, a panel of columns at a time (its constants hoisted): P, dS (over
    // dPᵀ), then P ∘ keep (over Sᵀ)
    const V ninf = vset<T>(NEG_INF<T>);
    const T* Lrow = lse2 + (b * P.Hq + h) * Tqp + a;
    const T* Drow = D + (b * P.Hq + h) * Tqp + a;
    const bool* kp = P.key_padding ? P.key_padding + b * P.Tk : nullptr;
    for (int64_t p = 0; p < np; ++p) {
      const int64_t j_lo = std::max(c, cols.plo[p]), j_hi = std::min(ce, cols.phi[p]);
      T* bt = nullptr;
      if (P.bias && j_lo < j_hi)
        bias_block(P, cols, p, j_lo, j_hi, bt = scratch(w.bt, size_t((j_hi - j_lo) * nr)));
      if (want & WANT_BIAS) {  // this panel's dZ, [j - c][NR], written out after the keys
        w.gzt.assign(size_t((ce - c) * nr), T(0));
      }
      const PanelMods<T> mods(P, cols, w.tk, b, p,
                              !(cols.maxlo[p] <= c && cols.minhi[p] >= ce), cap2, bt, j_lo);
      const V L[2] = {vload(Lrow + p * nr), vload(Lrow + p * nr + N)};
      const V Dv[2] = {vload(Drow + p * nr), vload(Drow + p * nr + N)};
      const uint32_t* rk = cols.rk.data() + p * nr;
      alignas(64) T gz[nr];  // the key row's dZ, for the learned tensors' gradients
      T* xs = nullptr;  // the block path's score_mod input, [j - j_lo][NR]
      if (mods.block && j_lo < j_hi) {
        xs = scratch(w.xs, size_t((j_hi - j_lo) * nr));
        for (int64_t j = j_lo; j < j_hi; ++j)
          std::copy_n(st + (j - c) * ld + p * nr, nr, xs + (j - j_lo) * nr);
        mods.smod_block(st + (j_lo - c) * ld + p * nr, ld, j_lo, j_hi);
      }
      mods.dispatch([&]<bool CAP, bool ALIBI, bool INTERVALS>() {
        for (int64_t j = c; j < ce; ++j) {
          T* x = st + (j - c) * ld + p * nr;
          T* y = dpt + (j - c) * ld + p * nr;
          if ((kp && !kp[j]) || !cols.reads(p, j)) {
            vstore(x, V{});
            vstore(x + N, V{});
            vstore(y, V{});
            vstore(y + N, V{});
            continue;
          }
          T* t = CAP ? th + (j - c) * ld + p * nr : nullptr;
          mods.template apply<CAP, ALIBI, INTERVALS>(j, x, t);
          if (P.dropout) drop_cols(y, rk, colkeys[j], P.drop_thr);
          V dsv[2], prv[2];
          for (int hh = 0; hh < 2; ++hh) {
            const V s = vload(x + hh * N);
            const auto blocked = s == ninf;  // exactly 0 there, whatever lse, dP and D are
            V pr = exp2v(s - L[hh]);
            pr = blocked ? V{} : pr;
            V ds = pr * (vload(y + hh * N) - Dv[hh]);
            dsv[hh] = blocked ? V{} : ds;
            prv[hh] = pr;
          }
          if (mods.sm && !mods.block) {  // d score_mod: d its input (its tables') from d output
            alignas(64) T db[nr];
            vstore(db, dsv[0]);
            vstore(db + N, dsv[1]);
            mods.smod_vjp(db, w.capacc);
            dsv[0] = vload(db);
            dsv[1] = vload(db + N);
          }
          for (int hh = 0; hh < 2; ++hh) {
            const V s = vload(x + hh * N);
            const auto blocked = s == ninf;
            const V pr = prv[hh];
            V ds = dsv[hh];
            if (want) vstore(gz + hh * N, ds);
            if (CAP) {  // tanh of a NaN score (a NaN q or k row) is NaN at blocked cells too
              const V tv = vload(t + hh * N);
              ds *= T(1) - tv * tv;
              ds = blocked ? V{} : ds;
            }
            vstore(x + hh * N, pr);
            vstore(y + hh * N, ds);
          }
          if (P.dropout) drop_cols(x, rk, colkeys[j], P.drop_thr);
          if (want) grad_cells(hkv, p, j - c, j, gz, cols, w);
        }
      });
      if (xs)
        mods.smod_block(xs, nr, j_lo, j_hi, dpt + (j_lo - c) * ld + p * nr, ld, w.capacc);
      mods.smod_finish(w.capacc);
      if (want & WANT_BIAS) {  // each column's dZ row, contiguous
        const int64_t c0 = p * nr;
        for (int64_t lane = 0; lane < std::min<int64_t>(nr, n - c0); ++lane) {
          T* dst = w.dz + cols.zoff[c0 + lane];
          for (int64_t j = c; j < ce; ++j) dst[j * zs[3]] += w.gzt[(j - c) * nr + lane];
        }
      }
    }
    if (want & WANT_SLOPES)  // the columns' slope sums into the task's (in column order)
      for (int64_t cc = 0; cc < n; ++cc) w.sacc[cols.head[cc] - hkv * P.g] -= w.slc[cc];
    // dV += P dO, dK += dS Q (keys as rows; zeroed operands, non-finite rows added below);
    // by output panel first, so that the panel of dO (of Q) stays in L1 over the key rows
    for (int64_t xp = 0; xp < dvp; xp += nr)
      for (int64_t j0 = 0; j0 < wk; j0 += MR)
        micro_rows<true>(int(std::min<int64_t>(MR, wk - j0)), n, st + j0 * ld, ld, 1,
                         w.pk.don + ((xp / nr) * Rq + r0) * nr, nr, dVacc + j0 * dvp + xp, dvp);
    for (int64_t xp = 0; xp < dkp; xp += nr)
      for (int64_t j0 = 0; j0 < wk; j0 += MR)
        micro_rows<true>(int(std::min<int64_t>(MR, wk - j0)), n, dpt + j0 * ld, ld, 1,
                         w.pk.qn + ((xp / nr) * Rq + r0) * nr, nr, dKacc + j0 * dkp + xp, dkp);
    // dQ += dSᵀ K over the keys each row panel of queries reads
    int64_t* rlo = scratch(w.rlo, size_t((n + MR - 1) / MR));
    int64_t* rhi = scratch(w.rhi, size_t((n + MR - 1) / MR));
    for (int64_t q0 = 0; q0 < n; q0 += MR) {
      int64_t k0 = ce, k1 = c;
      for (int64_t cc = q0; cc < std::min(n, q0 + MR); ++cc) {
        if (cols.lo[cc] >= cols.hi[cc]) continue;
        k0 = std::min(k0, std::max(c, int64_t(cols.lo[cc])));
        k1 = std::max(k1, std::min(ce, int64_t(cols.hi[cc])));
      }
      rlo[q0 / MR] = k0;
      rhi[q0 / MR] = k1;
    }
    for (int64_t xp = 0; xp < dkp; xp += nr) {
      for (int64_t q0 = 0; q0 < n; q0 += MR) {
        const int64_t k0 = rlo[q0 / MR], k1 = rhi[q0 / MR];
        if (k0 >= k1) continue;
        micro_rows<true>(int(std::min<int64_t>(MR, n - q0)), k1 - k0, dpt + (k0 - c) * ld + q0, 1,
                         ld, w.pk.kn + ((xp / nr) * Tpad + k0) * nr, nr,
                         dQacc + (r0 + q0) * dkp + xp, dkp);
      }
    }
    fixups(b, hkv, h, a, cols, c, ce, st, dpt, w, dKacc, dVacc, dQacc);
  }

  // key row j's dZ (NR columns of panel p; jc = j - c) into the panel's dZ block, the task's
  // d rel_bias (reversed rows: one vector where the panel is uniform) and Σ dZ·|pos − j|
  __attribute__((noinline)) void grad_cells(int64_t hkv, int64_t p, int64_t jc, int64_t j,
                                            const T* gz, const Cols<T>& cols,
                                            BWork<T>& w) const {
    const int64_t c0 = p * nr, n = std::min<int64_t>(cols.n - c0, nr);
    if (want & WANT_BIAS) {
      vstore(w.gzt.data() + jc * nr, vload(gz));
      vstore(w.gzt.data() + jc * nr + N, vload(gz + N));
    }
    if (want & WANT_REL) {
      T* ra = w.racc - hkv * P.g * P.rel_ld;  // roff holds the absolute head's row
      if (cols.runi[p]) {
        T* r = ra + cols.roff[c0] - j;
        vstore(r, vload(r) + vload(gz));
        vstore(r + N, vload(r + N) + vload(gz + N));
      } else {
        for (int64_t c = 0; c < n; ++c) ra[cols.roff[c0 + c] - j] += gz[c];
      }
    }
    if (want & WANT_SLOPES) {
      const T kpos = T(P.k_start + j);
      for (int hh = 0; hh < 2; ++hh) {
        V d = vload(cols.pos.data() + c0 + hh * N) - kpos;
        d = d < T(0) ? -d : d;
        T* acc = w.slc.data() + c0 + hh * N;
        vstore(acc, vload(acc) + vload(gz + hh * N) * d);
      }
    }
  }

  // the non-finite values the zeroed operands left out, added where their factor is not 0
  void fixups(int64_t b, int64_t hkv, int64_t h, int64_t a, const Cols<T>& cols, int64_t c,
              int64_t ce, const T* st, const T* dpt, BWork<T>& w, T* dKacc, T* dVacc,
              T* dQacc) const {
    const int64_t ld = cols.ld, r0 = (h - hkv * P.g) * Tqp + a;
    for (int64_t cc = 0; cc < cols.n; ++cc) {
      const int64_t r = r0 + cc, i = a + cc;
      if (w.pk.dobad[r]) {
        const I* g = dO.row(b, h, i);
        for (int64_t j = c; j < ce; ++j) {
          const T pij = st[(j - c) * ld + cc];
          if (pij == T(0)) continue;
          for (int64_t x = 0; x < P.dv; ++x) {
            const T y = T(g[x * dO.s3]) * zscale;
            if (!std::isfinite(y)) dVacc[(j - c) * dvp + x] += pij * y;
          }
        }
      }
      if (w.pk.qbad[r]) {
        const I* qr = Q.row(b, h, i);
        for (int64_t j = c; j < ce; ++j) {
          const T dsij = dpt[(j - c) * ld + cc];
          if (dsij == T(0)) continue;
          for (int64_t x = 0; x < P.dk; ++x) {
            const T y = T(qr[x * Q.s3]) * alpha;
            if (!std::isfinite(y)) dKacc[(j - c) * dkp + x] += dsij * y;
          }
        }
      }
    }
    for (int64_t j = c; j < ce; ++j) {
      if (!w.pk.kbad[j]) continue;
      for (int64_t cc = 0; cc < cols.n; ++cc) {
        const T dsij = dpt[(j - c) * ld + cc];
        if (dsij == T(0)) continue;
        T* dqr = dQacc + (r0 + cc) * dkp;
        for (int64_t x = 0; x < P.dk; ++x) {
          const T kx = w.pk.kr[kat(j, x, P.dk)];
          if (!std::isfinite(kx)) dqr[x] += dsij * kx;
        }
      }
    }
  }

  // the key blocks of a batch row and the lane each belongs to (largest first, to the least
  // loaded lane): fixed by the shape
  std::vector<int64_t> lane_of(int64_t b) const {
    const int64_t nkb = (P.Tk + bkb - 1) / bkb;
    std::vector<int64_t> lane(nkb, 0);
    if (lanes == 1) return lane;
    const int64_t *lo = P.lo_row(b), *hi = P.hi_row(b);
    std::vector<int64_t> cost(nkb, 0), load(lanes, 0);
    for (int64_t i = 0; i < P.Tq; ++i)
      for (int64_t kb = lo[i] / bkb; lo[i] < hi[i] && kb * bkb < hi[i]; ++kb) cost[kb] += 1;
    for (int64_t kb : by_cost(cost)) {
      const int64_t l = std::min_element(load.begin(), load.end()) - load.begin();
      lane[kb] = l;
      load[l] += cost[kb] + 1;
    }
    return lane;
  }

  void task(int64_t b, int64_t hkv, int64_t lane, const std::vector<int64_t>& lanes_of,
            BWork<T>& w) const {
    if (lanes > 1)  // the head's lanes share one packing, made before the tasks
      w.pk = views(shared + (b * P.Hkv + hkv) * (q_elems() + k_elems()),
                   shared_flags + (b * P.Hkv + hkv) * (2 * Rq + P.Tk));
    else
      pack(b, hkv, w);
    chunks(b, hkv, w);
    const int64_t task_id = (b * P.Hkv + hkv) * lanes + lane;
    if (want & WANT_REL) w.racc = racc_all + task_id * P.g * P.rel_ld;
    if (want & WANT_SLOPES) w.sacc = sacc_all + task_id * P.g;
    w.capacc = cap_all ? cap_all + task_id * P.smod.numel : nullptr;
    if (want & WANT_BIAS)
      w.dz = dz_out + ((zsplit_h ? hkv : 0) * (zsplit_l ? lanes : 1) + (zsplit_l ? lane : 0)) *
                          zpart;
    T* dQacc = lanes > 1 ? dq_lanes + ((b * P.Hkv + hkv) * lanes + lane) * Rq * dkp
                         : scratch(w.dq, size_t(Rq * dkp));
    std::fill(dQacc, dQacc + Rq * dkp, T(0));
    T* dKacc = scratch(w.dk, size_t(bkb * dkp));
    T* dVacc = scratch(w.dv, size_t(bkb * dvp));
    const int64_t nkb = (P.Tk + bkb - 1) / bkb, per_head = (P.Tq + bqb - 1) / bqb;
    const T kfac = T(P.softcap > 0 ? P.softcap : LN2);  // dK = scale·dSᵀQ = (scale/alpha)·...
    for (int64_t kb = 0; kb < nkb; ++kb) {
      if (lanes_of[kb] != lane) continue;
      const int64_t c = kb * bkb, ce = std::min(P.Tk, c + bkb);
      std::fill(dKacc, dKacc + bkb * dkp, T(0));
      std::fill(dVacc, dVacc + bkb * dvp, T(0));
      for (int64_t q = 0; q < P.g; ++q) {
        for (int64_t t = 0; t < per_head; ++t) {
          const Cols<T>& cols = w.chunks[q * per_head + t];
          if (cols.klo >= cols.khi || cols.khi <= c || cols.klo >= ce) continue;
          step(b, hkv, q, t * bqb, cols, c, ce, w, dKacc, dVacc, dQacc);
        }
      }
      for (int64_t j = c; j < ce; ++j) {
        I* dk = dk_out + ((b * P.Hkv + hkv) * P.Tk + j) * P.dk;
        I* dv = dv_out + ((b * P.Hkv + hkv) * P.Tk + j) * P.dv;
        const T* sk = dKacc + (j - c) * dkp;
        const T* sv = dVacc + (j - c) * dvp;
        for (int64_t x = 0; x < P.dk; ++x) dk[x] = I(sk[x] * kfac);
        for (int64_t x = 0; x < P.dv; ++x) dv[x] = I(sv[x]);
      }
    }
    if (lanes == 1)
      for (int64_t r = 0; r < Rq; ++r)
        if (r % Tqp < P.Tq) write_dq(b, hkv, r, dQacc + r * dkp);
  }

  // dQ row r (stacked) of (b, kv head) from its accumulator: dQ = scale · dSᵀ K
  void write_dq(int64_t b, int64_t hkv, int64_t r, const T* acc) const {
    I* o = dq_out + ((b * P.Hq + hkv * P.g + r / Tqp) * P.Tq + r % Tqp) * P.dk;
    for (int64_t x = 0; x < P.dk; ++x) o[x] = I(acc[x] * T(P.scale));
  }
};

template <typename T>
BWork<T>& thread_work() {
  thread_local BWork<T> w;
  return w;
}

template <typename I, typename T>
void run(const Problem& P, const Options& o, const at::Tensor& out, const at::Tensor& dout,
         const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
         std::vector<at::Tensor>& g) {
  at::Tensor &dq = g[0], &dk = g[1], &dv = g[2];
  const int64_t Tqp = round_up<T>(P.Tq), rows = P.B * P.Hq * Tqp;
  const auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  at::Tensor aux = at::empty({2 * rows}, opts);
  T* D = aux.data_ptr<T>();
  T* lse2 = D + rows;
  {
    View4<I> O(out), G(dout);
    at::Tensor lse_t = lse.to(c10::CppTypeToScalarType<T>::value).contiguous();
    const T* L = lse_t.data_ptr<T>();
    at::Tensor dl;
    const T* DL = nullptr;
    if (dlse) {
      dl = dlse->to(c10::CppTypeToScalarType<T>::value).contiguous();
      DL = dl.data_ptr<T>();
    }
    at::parallel_for(0, P.B * P.Hq, 1, [&](int64_t h0, int64_t h1) {
      for (int64_t bh = h0; bh < h1; ++bh) {
        const int64_t b = bh / P.Hq, h = bh % P.Hq;
        for (int64_t i = 0; i < Tqp; ++i) {
          const int64_t r = bh * Tqp + i, src = bh * P.Tq + i;
          if (i >= P.Tq) {
            D[r] = T(0);
            lse2[r] = std::numeric_limits<T>::infinity();
            continue;
          }
          const I* o = O.row(b, h, i);
          const I* g = G.row(b, h, i);
          T s = 0;
          for (int64_t x = 0; x < P.dv; ++x) s += T(o[x * O.s3]) * T(g[x * G.s3]);
          D[r] = DL ? s - DL[src] : s;
          lse2[r] = L[src] == NEG_INF<T> ? std::numeric_limits<T>::infinity()
                                         : T(double(L[src]) * LOG2E);
        }
      }
    });
  }
  Backward<I, T> bw(P, o.bk, o.bq, o.lanes, dout, D, lse2, static_cast<I*>(dq.data_ptr()),
                    static_cast<I*>(dk.data_ptr()), static_cast<I*>(dv.data_ptr()));
  bw.want = o.want;
  const int64_t ntasks = P.B * P.Hkv * o.lanes;
  at::Tensor racc, sacc;
  at::Tensor dz_parts;
  int64_t nparts = 1;
  if (o.want & WANT_BIAS) {  // parts where tasks running at once would add to one cell
    const at::Tensor& db = g[4];
    bw.zpart = db.numel();
    for (int d = 0; d < 4; ++d) bw.zs[d] = db.size(d) > 1 ? db.stride(d) : 0;
    bw.zsplit_h = db.size(1) == 1 && P.Hkv > 1;
    bw.zsplit_l = db.size(3) == 1 && o.lanes > 1;
    nparts = (bw.zsplit_h ? P.Hkv : 1) * (bw.zsplit_l ? o.lanes : 1);
    if (nparts > 1) {
      dz_parts = at::zeros({nparts, bw.zpart}, opts);
      bw.dz_out = dz_parts.data_ptr<T>();
    } else {
      bw.dz_out = db.data_ptr<T>();
    }
  }
  // tasks of every batch row run as one, in b order, when d bias is shared over the batch
  const bool bgroup = (o.want & WANT_BIAS) && g[4].size(0) == 1 && P.B > 1;
  if (o.want & WANT_REL) {
    racc = at::zeros({ntasks, P.g, P.rel_ld}, opts);
    bw.racc_all = racc.data_ptr<T>();
  }
  if (o.want & WANT_SLOPES) {
    sacc = at::zeros({ntasks, P.g}, opts);
    bw.sacc_all = sacc.data_ptr<T>();
  }
  at::Tensor capg;
  if (P.smod.on() && P.smod.grad) {
    capg = at::zeros({ntasks, P.smod.numel}, opts);
    bw.cap_all = capg.data_ptr<T>();
  }
  at::Tensor lane_buf;
  if (o.lanes > 1) {
    lane_buf = at::empty({P.B * P.Hkv * o.lanes * bw.Rq * bw.dkp}, opts);
    bw.dq_lanes = lane_buf.data_ptr<T>();
  }
  at::Tensor shared, shared_flags;
  if (o.lanes > 1) {  // pack each head once, in row chunks over the threads
    const int64_t heads = P.B * P.Hkv, per = bw.q_elems() + bw.k_elems();
    shared = at::empty({heads * per}, opts);
    shared_flags = at::empty({heads * (2 * bw.Rq + P.Tk)}, at::kByte);
    bw.shared = shared.data_ptr<T>();
    bw.shared_flags = shared_flags.data_ptr<uint8_t>();
    const int64_t chunk = 64, nq = (bw.Rq + chunk - 1) / chunk, nk = (P.Tk + chunk - 1) / chunk;
    at::parallel_for(0, heads * (nq + nk), 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t hh = t / (nq + nk), c = t % (nq + nk);
        const Packed<T> k = bw.views(bw.shared + hh * per, bw.shared_flags + hh * (2 * bw.Rq + P.Tk));
        if (c < nq)
          bw.pack_rows(hh / P.Hkv, hh % P.Hkv, c * chunk, std::min(bw.Rq, (c + 1) * chunk), 0, 0, k);
        else
          bw.pack_rows(hh / P.Hkv, hh % P.Hkv, 0, 0, (c - nq) * chunk,
                       std::min(P.Tk, (c - nq + 1) * chunk), k);
      }
    });
  }
  std::vector<std::vector<int64_t>> lanes_of(P.B);
  for (int64_t b = 0; b < P.B; ++b)
    lanes_of[b] = (P.lo_b == 0 && b > 0) ? lanes_of[0] : bw.lane_of(b);
  const int64_t n = (bgroup ? 1 : P.B) * P.Hkv * o.lanes;
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  const int64_t work = P.B * P.Hq * P.Tq * P.Tk * (P.dk + P.dv);
  run_tasks(order, work, [&](int64_t t, int64_t) {
    const int64_t b = t / (P.Hkv * o.lanes), hkv = (t / o.lanes) % P.Hkv, lane = t % o.lanes;
    if (bgroup)
      for (int64_t bb = 0; bb < P.B; ++bb) bw.task(bb, hkv, lane, lanes_of[bb], thread_work<T>());
    else
      bw.task(b, hkv, lane, lanes_of[b], thread_work<T>());
  });
  if (nparts > 1) {  // d bias = Σ parts, in part order
    T* db = g[4].data_ptr<T>();
    const T* parts = dz_parts.data_ptr<T>();
    const int64_t m = bw.zpart;
    at::parallel_for(0, m, 4096, [&](int64_t e0, int64_t e1) {
      for (int64_t e = e0; e < e1; ++e) {
        T s = 0;
        for (int64_t q = 0; q < nparts; ++q) s += parts[q * m + e];
        db[e] = s;
      }
    });
  }
  if (o.lanes > 1) {  // dQ = Σ over lanes, in lane order
    const int64_t heads = P.B * P.Hkv, R = bw.Rq, dkp = bw.dkp;
    at::parallel_for(0, heads * R, 64, [&](int64_t t0, int64_t t1) {
      std::vector<T> acc(dkp);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t hh = t / R, r = t % R;
        if (r % Tqp >= P.Tq) continue;
        std::fill(acc.begin(), acc.end(), T(0));
        for (int64_t l = 0; l < o.lanes; ++l) {
          const T* src = bw.dq_lanes + ((hh * o.lanes + l) * R + r) * dkp;
          for (int64_t x = 0; x < dkp; ++x) acc[x] += src[x];
        }
        bw.write_dq(hh / P.Hkv, hh % P.Hkv, r, acc.data());
      }
    });
  }
  // the learned tensors' gradients: the tasks' partial sums in task order (fixed by the shape)
  if (o.want & WANT_REL) {
    const int64_t R = P.rel_ld - 2 * REL_PAD;
    T* dr = g[5].data_ptr<T>();
    const T* ra = bw.racc_all;
    for (int64_t t = 0; t < ntasks; ++t) {
      const int64_t hkv = (t / o.lanes) % P.Hkv;
      for (int64_t q = 0; q < P.g; ++q) {
        const T* src = ra + (t * P.g + q) * P.rel_ld + REL_PAD + R - 1;  // reversed
        T* dst = dr + (hkv * P.g + q) * R;
        for (int64_t r = 0; r < R; ++r) dst[r] += src[-r];
      }
    }
  }
  if (bw.cap_all) {  // the tables' gradients: the tasks' sums in task order
    T* dst = g[6].data_ptr<T>();
    const int64_t m = P.smod.numel;
    at::parallel_for(0, m, 4096, [&](int64_t e0, int64_t e1) {
      for (int64_t e = e0; e < e1; ++e) {
        T s = 0;
        for (int64_t t = 0; t < ntasks; ++t) s += bw.cap_all[t * m + e];
        dst[e] = s;
      }
    });
  }
  if (o.want & WANT_SLOPES) {
    T* ds = g[3].data_ptr<T>();
    for (int64_t t = 0; t < ntasks; ++t) {
      const int64_t b = t / (P.Hkv * o.lanes), hkv = (t / o.lanes) % P.Hkv;
      for (int64_t q = 0; q < P.g; ++q)
        ds[(P.slopes_b ? b : 0) * P.Hq + hkv * P.g + q] += bw.sacc_all[t * P.g + q];
    }
  }
}

}  // namespace

std::vector<at::Tensor> backward(const Problem& P, const Options& o, const at::Tensor& out,
                                 const at::Tensor& dout, const at::Tensor& lse,
                                 const std::optional<at::Tensor>& dlse) {
  const auto ct = P.q.options().dtype(P.dtype == at::kDouble ? at::kDouble : at::kFloat);
  std::vector<at::Tensor> g = {
      at::zeros({P.B, P.Hq, P.Tq, P.dk}, P.q.options()),
      at::zeros({P.B, P.Hkv, P.Tk, P.dk}, P.q.options()),
      at::zeros({P.B, P.Hkv, P.Tk, P.dv}, P.q.options()),
      at::zeros({(o.want & WANT_SLOPES) ? (P.slopes_b ? P.B : 1) : 0, P.Hq}, ct),
      at::zeros((o.want & WANT_BIAS) ? P.bias_sizes : std::vector<int64_t>{0}, ct),
      at::zeros({P.Hq, (o.want & WANT_REL) ? P.rel_ld - 2 * REL_PAD : 0}, ct),
      at::zeros({P.smod.on() && P.smod.grad ? P.smod.numel : 0}, ct)};
  if (P.B == 0 || P.Tq == 0 || P.Tk == 0) return g;
  switch (P.dtype) {
    case at::kFloat: run<float, float>(P, o, out, dout, lse, dlse, g); break;
    case at::kDouble: run<double, double>(P, o, out, dout, lse, dlse, g); break;
    case at::kBFloat16: run<c10::BFloat16, float>(P, o, out, dout, lse, dlse, g); break;
    case at::kHalf: run<c10::Half, float>(P, o, out, dout, lse, dlse, g); break;
    default: TORCH_CHECK(false, "causalattn cpp: unsupported dtype ", P.dtype);
  }
  return g;
}

}  // namespace causalattn
