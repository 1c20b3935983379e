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

template <typename T>
struct BWork {  // a thread's buffers, reused across tasks and calls
  std::vector<T> qp_b, qn_b, dop_b, don_b, kr_b, vr_b, kn_b, st, dpt, th, dk, dv, dq;
  std::vector<uint8_t> qbad_b, dobad_b, kbad_b;
  T *qp, *qn, *dop, *don, *kr, *vr, *kn;  // the task's packed operands (see pack())
  uint8_t *qbad, *dobad, *kbad;
  std::vector<Cols<T>> chunks;
  std::vector<int64_t> rlo, rhi;
  TileKinds tk;
};

template <typename I, typename T>
struct Backward {
  using V = typename Vec<T>::v;
  static constexpr int N = Vec<T>::N;
  static constexpr int nr = NR<T>;

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

  // The head's operands, packed once per task: Qp, dOp [query panel][x][NR] (B operands of
  // Sᵀ = K Qᵀ, dPᵀ = V dOᵀ; the values as given); Qn, dOn [x panel][row][NR] (B operands of
  // dK += dS Q, dV += P dO; non-finite values zeroed, their rows marked); K, V as rows in
  // the compute type (A operands); Kn [x panel][key][NR] (B of dQ += dSᵀ K; zeroed, marked).
  void pack(int64_t b, int64_t hkv, BWork<T>& w) const {
    const int64_t dk = P.dk, dv = P.dv;
    T* qp = w.qp = scratch(w.qp_b, size_t(Rq * dk));
    T* dop = w.dop = scratch(w.dop_b, size_t(Rq * dv));
    T* qn = w.qn = scratch(w.qn_b, size_t(dkp * Rq));
    T* don = w.don = scratch(w.don_b, size_t(dvp * Rq));
    uint8_t* qbad = w.qbad = scratch(w.qbad_b, size_t(Rq));
    uint8_t* dobad = w.dobad = scratch(w.dobad_b, size_t(Rq));
    for (int64_t r = 0; r < Rq; ++r) {
      const int64_t q = r / Tqp, i = r % Tqp, h = hkv * P.g + q;
      const bool real = i < P.Tq;
      const I* qr = real ? Q.row(b, h, i) : nullptr;
      const I* gr = real ? dO.row(b, h, i) : nullptr;
      T* qpd = qp + (r / nr) * dk * nr + r % nr;
      T* dpd = dop + (r / nr) * dv * nr + r % nr;
      uint8_t qb = 0, gb = 0;
      for (int64_t x = 0; x < dk; ++x) {
        const T y = real ? T(qr[x * Q.s3]) * alpha : T(0);
        qpd[x * nr] = y;
        const bool f = std::isfinite(y);
        qb |= !f;
        qn[((x / nr) * Rq + r) * nr + x % nr] = f ? y : T(0);
      }
      for (int64_t x = dk; x < dkp; ++x) qn[((x / nr) * Rq + r) * nr + x % nr] = T(0);
      for (int64_t x = 0; x < dv; ++x) {
        const T y = real ? T(gr[x * dO.s3]) * zscale : T(0);
        dpd[x * nr] = y;
        const bool f = std::isfinite(y);
        gb |= !f;
        don[((x / nr) * Rq + r) * nr + x % nr] = f ? y : T(0);
      }
      for (int64_t x = dv; x < dvp; ++x) don[((x / nr) * Rq + r) * nr + x % nr] = T(0);
      qbad[r] = qb;
      dobad[r] = gb;
    }
    T* kr = w.kr = scratch(w.kr_b, size_t(P.Tk * dk));
    T* vr = w.vr = scratch(w.vr_b, size_t(P.Tk * dv));
    for (int64_t j = 0; j < P.Tk; ++j) {
      const I* ks = K.row(b, hkv, j);
      const I* vs = Vv.row(b, hkv, j);
      for (int64_t x = 0; x < dk; ++x) kr[j * dk + x] = T(ks[x * K.s3]);
      for (int64_t x = 0; x < dv; ++x) vr[j * dv + x] = T(vs[x * Vv.s3]);
    }
    w.kn = scratch(w.kn_b, size_t(dkp * Tpad));
    w.kbad = scratch(w.kbad_b, size_t(P.Tk));
    pack_n<T, T>(kr, dk, 1, P.Tk, Tpad, dk, w.kn, w.kbad);
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
    T* dpt = scratch(w.dpt, size_t(bkb * ld));
    T* th = cap2 != T(0) ? scratch(w.th, size_t(bkb * ld)) : nullptr;
    const T* kr = w.kr;
    const T* vr = w.vr;
    // Sᵀ = K Qᵀ, dPᵀ = V dOᵀ for the key rows some column of a panel reads
    for (int64_t p = 0; p < np; ++p) {
      const int64_t j_lo = std::max(c, cols.plo[p]), j_hi = std::min(ce, cols.phi[p]);
      const T* bq_ = w.qp + (r0 / nr + p) * P.dk * nr;
      const T* bo_ = w.dop + (r0 / nr + p) * P.dv * nr;
      for (int64_t j0 = j_lo; j0 < j_hi; j0 += MR) {
        const int rows = int(std::min<int64_t>(MR, j_hi - j0));
        micro_rows<false>(rows, P.dk, kr + j0 * P.dk, P.dk, 1, bq_, nr,
                          st + (j0 - c) * ld + p * nr, ld);
        micro_rows<false>(rows, P.dv, vr + j0 * P.dv, P.dv, 1, bo_, nr,
                          dpt + (j0 - c) * ld + p * nr, ld);
      }
    }
    // the vertical pass: P, dS (over dPᵀ), and P ∘ keep (over Sᵀ)
    const V ninf = vset<T>(NEG_INF<T>);
    const T* Lrow = lse2 + (b * P.Hq + h) * Tqp + a;
    const T* Drow = D + (b * P.Hq + h) * Tqp + a;
    for (int64_t j = c; j < ce; ++j) {
      T* srow = st + (j - c) * ld;
      T* drow = dpt + (j - c) * ld;
      const bool padded = P.key_padding && !P.key_padding[b * P.Tk + j];
      for (int64_t p = 0; p < np; ++p) {
        T* x = srow + p * nr;
        T* y = drow + p * nr;
        if (padded || !cols.reads(p, j)) {
          vstore(x, V{});
          vstore(x + N, V{});
          vstore(y, V{});
          vstore(y + N, V{});
          continue;
        }
        const bool need = !(cols.maxlo[p] <= c && cols.minhi[p] >= ce);
        T* t = th ? th + (j - c) * ld + p * nr : nullptr;
        modify_and_mask(P, cols, w.tk, b, j, p, need, cap2, x, t);
        if (P.dropout) drop_cols(y, cols.rk.data() + p * nr, colkeys[j], P.drop_thr);
        for (int hh = 0; hh < 2; ++hh) {
          const V s = vload(x + hh * N);
          const auto blocked = s == ninf;  // exactly 0 there, whatever lse, dP and D are
          V pr = exp2v(s - vload(Lrow + p * nr + hh * N));
          pr = blocked ? V{} : pr;
          V ds = pr * (vload(y + hh * N) - vload(Drow + p * nr + hh * N));
          ds = blocked ? V{} : ds;
          if (t) {
            const V tv = vload(t + hh * N);
            ds *= T(1) - tv * tv;
          }
          vstore(x + hh * N, pr);
          vstore(y + hh * N, ds);
        }
        if (P.dropout) drop_cols(x, cols.rk.data() + p * nr, colkeys[j], P.drop_thr);
      }
    }
    // dV += P dO, dK += dS Q (keys as rows; zeroed operands, non-finite rows added below)
    for (int64_t j0 = 0; j0 < wk; j0 += MR) {
      const int rows = int(std::min<int64_t>(MR, wk - j0));
      for (int64_t xp = 0; xp < dvp; xp += nr)
        micro_rows<true>(rows, n, st + j0 * ld, ld, 1, w.don + ((xp / nr) * Rq + r0) * nr,
                         nr, dVacc + j0 * dvp + xp, dvp);
      for (int64_t xp = 0; xp < dkp; xp += nr)
        micro_rows<true>(rows, n, dpt + j0 * ld, ld, 1, w.qn + ((xp / nr) * Rq + r0) * nr,
                         nr, dKacc + j0 * dkp + xp, dkp);
    }
    // dQ += dSᵀ K over the keys each row panel of queries reads
    for (int64_t q0 = 0; q0 < n; q0 += MR) {
      int64_t k0 = ce, k1 = c;
      for (int64_t cc = q0; cc < std::min(n, q0 + MR); ++cc) {
        if (cols.lo[cc] >= cols.hi[cc]) continue;
        k0 = std::min(k0, std::max(c, int64_t(cols.lo[cc])));
        k1 = std::max(k1, std::min(ce, int64_t(cols.hi[cc])));
      }
      if (k0 >= k1) continue;
      const int rows = int(std::min<int64_t>(MR, n - q0));
      for (int64_t xp = 0; xp < dkp; xp += nr)
        micro_rows<true>(rows, k1 - k0, dpt + (k0 - c) * ld + q0, 1, ld,
                         w.kn + ((xp / nr) * Tpad + k0) * nr, nr,
                         dQacc + (r0 + q0) * dkp + xp, dkp);
    }
    fixups(b, hkv, h, a, cols, c, ce, st, dpt, w, dKacc, dVacc, dQacc);
  }

  // the non-finite values the zeroed operands left out, added where their factor is not 0
  void fixups(int64_t b, int64_t hkv, int64_t h, int64_t a, const Cols<T>& cols, int64_t c,
              int64_t ce, const T* st, const T* dpt, BWork<T>& w, T* dKacc, T* dVacc,
              T* dQacc) const {
    const int64_t ld = cols.ld, r0 = (h - hkv * P.g) * Tqp + a;
    for (int64_t cc = 0; cc < cols.n; ++cc) {
      const int64_t r = r0 + cc, i = a + cc;
      if (w.dobad[r]) {
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
      if (w.qbad[r]) {
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
      if (!w.kbad[j]) continue;
      const T* kr = w.kr + j * P.dk;
      for (int64_t cc = 0; cc < cols.n; ++cc) {
        const T dsij = dpt[(j - c) * ld + cc];
        if (dsij == T(0)) continue;
        T* dqr = dQacc + (r0 + cc) * dkp;
        for (int64_t x = 0; x < P.dk; ++x)
          if (!std::isfinite(kr[x])) dqr[x] += dsij * kr[x];
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
    pack(b, hkv, w);
    chunks(b, hkv, w);
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
         const at::Tensor& lse, const std::optional<at::Tensor>& dlse, at::Tensor& dq,
         at::Tensor& dk, at::Tensor& dv) {
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
  at::Tensor lane_buf;
  if (o.lanes > 1) {
    lane_buf = at::empty({P.B * P.Hkv * o.lanes * bw.Rq * bw.dkp}, opts);
    bw.dq_lanes = lane_buf.data_ptr<T>();
  }
  std::vector<std::vector<int64_t>> lanes_of(P.B);
  for (int64_t b = 0; b < P.B; ++b)
    lanes_of[b] = (P.lo_b == 0 && b > 0) ? lanes_of[0] : bw.lane_of(b);
  const int64_t n = P.B * P.Hkv * o.lanes;
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  const int64_t work = P.B * P.Hq * P.Tq * P.Tk * (P.dk + P.dv);
  run_tasks(order, work, [&](int64_t t, int64_t) {
    const int64_t b = t / (P.Hkv * o.lanes), hkv = (t / o.lanes) % P.Hkv, lane = t % o.lanes;
    bw.task(b, hkv, lane, lanes_of[b], thread_work<T>());
  });
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
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const Problem& P, const Options& o,
                                                         const at::Tensor& out,
                                                         const at::Tensor& dout,
                                                         const at::Tensor& lse,
                                                         const std::optional<at::Tensor>& dlse) {
  at::Tensor dq = at::zeros({P.B, P.Hq, P.Tq, P.dk}, P.q.options());
  at::Tensor dk = at::zeros({P.B, P.Hkv, P.Tk, P.dk}, P.q.options());
  at::Tensor dv = at::zeros({P.B, P.Hkv, P.Tk, P.dv}, P.q.options());
  if (P.B == 0 || P.Tq == 0 || P.Tk == 0) return {dq, dk, dv};
  switch (P.dtype) {
    case at::kFloat: run<float, float>(P, o, out, dout, lse, dlse, dq, dk, dv); break;
    case at::kDouble: run<double, double>(P, o, out, dout, lse, dlse, dq, dk, dv); break;
    case at::kBFloat16: run<c10::BFloat16, float>(P, o, out, dout, lse, dlse, dq, dk, dv); break;
    case at::kHalf: run<c10::Half, float>(P, o, out, dout, lse, dlse, dq, dk, dv); break;
    default: TORCH_CHECK(false, "causalattn cpp: unsupported dtype ", P.dtype);
  }
  return {dq, dk, dv};
}

}  // namespace causalattn
