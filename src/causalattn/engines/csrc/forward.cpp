// The forward pass. Blocks: one fused pass per (batch row, kv head, block of query rows) —
// the transposed score tile Sᵀ = K Qᵀ, scale, softcap, ALiBi, the pattern, the online
// softmax with sinks, dropout, H += P V, and the log-sum-exp. Decoding (few query rows
// against many keys): one pass per (batch row, kv head, key split), merged in split order.
// See causalattn/engines/cpp.py for the contract.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "tile.h"

namespace causalattn {
namespace {

template <typename T>
constexpr T NEG_INF = -std::numeric_limits<T>::infinity();

template <typename T>
struct Work {  // a thread's buffers, reused across tasks and calls
  std::vector<T> qp, st, acc, m, l, alpha, qs, bt;
  Cols<T> cols;
  TileKinds tk;
  std::vector<int64_t> rlo, rhi;
};

template <typename I, typename T>
struct Forward {
  using V = typename Vec<T>::v;
  static constexpr int N = Vec<T>::N;
  static constexpr int nr = NR<T>;
  static constexpr int64_t KC = 256;  // K-blocking of the score GEMM (large head sizes)

  const Problem& P;
  int64_t bq, bk, dvp;
  T alpha;  // Q's factor: scores leave the GEMM in base 2 (or as S/c with softcap)
  T cap2;   // softcap·log2 e, 0 without softcap
  View4<I> Q, K, Vv;
  at::Tensor kp_t, vp_t, vbad_t;
  const T* Kp = nullptr;  // K packed in MR-key panels (see prepare)
  const T* Vp = nullptr;
  const uint8_t* vbad = nullptr;  // (B·Hkv, Tk) when V was copied with non-finite values
  std::vector<uint32_t> colkeys;  // dropout column keys of every key
  I* out;  // (B, Hq, Tq, dv)
  T* lse;  // (B, Hq, Tq)
  int64_t splits = 1;  // decoding: partial m, l, acc per (b, q head, row, split)
  T *sm = nullptr, *sl = nullptr, *sacc = nullptr;

  Forward(const Problem& p, int64_t bq_, int64_t bk_, I* out_, T* lse_)
      : P(p), bq(bq_), bk(bk_), Q(p.q), K(p.k), Vv(p.v), out(out_), lse(lse_) {
    dvp = round_up<T>(P.dv);
    if (P.softcap > 0) {
      alpha = T(P.scale / P.softcap);
      cap2 = T(P.softcap * LOG2E);
    } else {
      alpha = T(P.scale * LOG2E);
      cap2 = T(0);
    }
    if (P.dropout) {
      colkeys.resize(P.Tk);
      for (int64_t j = 0; j < P.Tk; ++j) colkeys[j] = col_key(P.k_start + j);
    }
  }

  // K and V packed once per call (blocks only: decoding reads the tensors directly), each
  // as its GEMM reads it sequentially: K [b·kv head][MR-key panel][x][MR] (the A operand of
  // Sᵀ = K Qᵀ, zero keys past T_k), V [b·kv head][value panel][key][NR] (the B operand of
  // P V). Non-finite values of V are zeroed (zero weights must not meet them) and their keys
  // marked in vbad; the readable ones are added back exactly (see tile()).
  void prepare() {
    const int64_t heads = P.B * P.Hkv, npv = dvp / nr, nkp = kpanels();
    kp_t = at::empty({heads * nkp * P.dk * MR},
                     at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
    T* kp = kp_t.template data_ptr<T>();
    at::parallel_for(0, heads * nkp, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t bh = t / nkp, jp = t % nkp;
        T* dst = kp + t * P.dk * MR;
        for (int64_t r = 0; r < MR; ++r) {
          const int64_t j = jp * MR + r;
          const I* src = j < P.Tk ? K.row(bh / P.Hkv, bh % P.Hkv, j) : nullptr;
          for (int64_t x = 0; x < P.dk; ++x) dst[x * MR + r] = src ? T(src[x * K.s3]) : T(0);
        }
      }
    });
    Kp = kp;
    vp_t = at::empty({heads * npv * P.Tk * nr},
                     at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
    vbad_t = at::zeros({heads * P.Tk}, at::kByte);
    T* vp = vp_t.template data_ptr<T>();
    uint8_t* bad = vbad_t.template data_ptr<uint8_t>();
    std::atomic<bool> any_bad{false};
    at::parallel_for(0, heads, 1, [&](int64_t h0, int64_t h1) {
      for (int64_t bh = h0; bh < h1; ++bh) {
        for (int64_t j = 0; j < P.Tk; ++j) {
          const I* src = Vv.row(bh / P.Hkv, bh % P.Hkv, j);
          uint8_t nonfinite = 0;
          for (int64_t dp = 0; dp < npv; ++dp) {
            T* dst = vp + ((bh * npv + dp) * P.Tk + j) * nr;
            for (int64_t n = 0; n < nr; ++n) {
              const int64_t x = dp * nr + n;
              T y = x < P.dv ? T(src[x * Vv.s3]) : T(0);
              if (!std::isfinite(y)) {
                nonfinite = 1;
                y = T(0);
              }
              dst[n] = y;
            }
          }
          if (nonfinite) {
            bad[bh * P.Tk + j] = 1;
            any_bad = true;
          }
        }
      }
    });
    Vp = vp;
    vbad = any_bad ? bad : nullptr;
  }
  int64_t kpanels() const { return (P.Tk + MR - 1) / MR; }
  // K's MR-key panel holding key j (a multiple of MR), from dimension x on
  const T* kpanel(int64_t b, int64_t hkv, int64_t j, int64_t x) const {
    return Kp + ((b * P.Hkv + hkv) * kpanels() + j / MR) * P.dk * MR + x * MR;
  }
  const T* vpanel(int64_t b, int64_t hkv, int64_t dp, int64_t j) const {
    return Vp + (((b * P.Hkv + hkv) * (dvp / nr) + dp / nr) * P.Tk + j) * nr;
  }

  void columns(Cols<T>& cols, int64_t b, int64_t hkv, int64_t a, int64_t a2) const {
    const int64_t n_i = a2 - a;
    cols.n = P.g * n_i;
    cols.head.resize(cols.n);
    cols.i.resize(cols.n);
    for (int64_t c = 0; c < cols.n; ++c) {
      cols.head[c] = hkv * P.g + c / n_i;
      cols.i[c] = a + c % n_i;
    }
    cols.build(P, b);
  }

  // out, lse of the columns from the final m, l, acc (sinks join the denominator)
  void finish(const Cols<T>& cols, int64_t b, const T* m, const T* l, const T* acc,
              int64_t ldacc) const {
    for (int64_t c = 0; c < cols.n; ++c) {
      const int64_t h = cols.head[c], i = cols.i[c];
      I* o = out + ((b * P.Hq + h) * P.Tq + i) * P.dv;
      T* L = lse + (b * P.Hq + h) * P.Tq + i;
      T mr = m[c], lr = l[c];
      if (lr == T(0)) {  // no readable key: a zero row, whatever the sinks
        std::fill(o, o + P.dv, I(0));
        *L = NEG_INF<T>;
        continue;
      }
      T rescale = 1;
      if (P.sinks) {
        const T s2 = T(P.sinks[h] * LOG2E);
        const T mm = mr > s2 ? mr : s2;
        rescale = exp2s<T>(mr - mm);
        lr = lr * rescale + exp2s<T>(s2 - mm);
        mr = mm;
      }
      const T f = rescale * T(P.drop_scale) / lr;
      const T* ar = acc + c * ldacc;
      for (int64_t x = 0; x < P.dv; ++x) o[x] = I(ar[x] * f);
      *L = T((double(mr) + std::log2(double(lr))) * LN2);
    }
  }

  // ---- blocks ----------------------------------------------------------------------------
  void task_block(int64_t b, int64_t hkv, int64_t qb, Work<T>& w) const {
    Cols<T>& cols = w.cols;
    columns(cols, b, hkv, qb * bq, std::min(P.Tq, (qb + 1) * bq));
    const int64_t R = cols.n, ld = cols.ld, np = cols.panels();
    T* acc = scratch(w.acc, size_t(R * dvp));
    T* m = scratch(w.m, size_t(ld));
    T* l = scratch(w.l, size_t(ld));
    std::fill(acc, acc + R * dvp, T(0));
    std::fill(m, m + ld, NEG_INF<T>);
    std::fill(l, l + ld, T(0));
    if (cols.klo >= cols.khi) {
      finish(cols, b, m, l, acc, dvp);
      return;
    }
    // Q of the columns, packed: Qp[panel][x][NR] (the B operand of Sᵀ = K Qᵀ)
    T* qp = scratch(w.qp, size_t(ld * P.dk));
    for (int64_t p = 0; p < np; ++p) {
      T* dst = qp + p * P.dk * nr;
      for (int64_t n = 0; n < nr; ++n) {
        const int64_t c = p * nr + n;
        if (c < R) {
          const I* src = Q.row(b, cols.head[c], cols.i[c]);
          for (int64_t x = 0; x < P.dk; ++x) dst[x * nr + n] = T(src[x * Q.s3]) * alpha;
        } else {
          for (int64_t x = 0; x < P.dk; ++x) dst[x * nr + n] = T(0);
        }
      }
    }
    // per MR-query row panel: the hull of its intervals (the keys P V reads for it)
    const int64_t nrp = (R + MR - 1) / MR;
    int64_t* rlo = scratch(w.rlo, size_t(nrp));
    int64_t* rhi = scratch(w.rhi, size_t(nrp));
    for (int64_t q = 0; q < nrp; ++q) {
      rlo[q] = P.Tk;
      rhi[q] = 0;
      for (int64_t c = q * MR; c < std::min(R, (q + 1) * MR); ++c)
        if (cols.lo[c] < cols.hi[c]) {
          rlo[q] = std::min(rlo[q], int64_t(cols.lo[c]));
          rhi[q] = std::max(rhi[q], int64_t(cols.hi[c]));
        }
    }
    T* st = scratch(w.st, size_t(bk * ld));
    T* al = scratch(w.alpha, size_t(ld));
    for (int64_t kb = cols.klo / bk; kb * bk < cols.khi; ++kb) {
      const int64_t c = kb * bk, ce = std::min((kb + 1) * bk, cols.khi);
      w.tk.build(P, b, hkv * P.g, P.g, qb, kb);
      if (!w.tk.any_read) continue;
      tile(w, b, hkv, c, ce, qp, st, m, l, al, acc, rlo, rhi);
    }
    finish(cols, b, m, l, acc, dvp);
  }

  __attribute__((noinline)) void tile(Work<T>& w, int64_t b, int64_t hkv, int64_t c, int64_t ce, const T* qp, T* st, T* m,
            T* l, T* al, T* acc, const int64_t* rlo, const int64_t* rhi) const {
    const Cols<T>& cols = w.cols;
    const int64_t R = cols.n, ld = cols.ld, np = cols.panels();
    // Sᵀ[j - c, col] = K[j] · Qp[col] for the MR-key panels some column of a panel reads
    // (the tile starts on a panel: c is a multiple of bk, a multiple of MR)
    for (int64_t k0 = 0; k0 < P.dk; k0 += KC) {
      const int64_t kc = std::min(KC, P.dk - k0);
      for (int64_t p = 0; p < np; ++p) {
        const int64_t j_lo = std::max(c, cols.plo[p]), j_hi = std::min(ce, cols.phi[p]);
        const T* Bp = qp + (p * P.dk + k0) * nr;
        for (int64_t j0 = j_lo / MR * MR; j0 < j_hi; j0 += MR) {
          const T* A = kpanel(b, hkv, j0, k0);
          T* C = st + (j0 - c) * ld + p * nr;
          if (k0 == 0)
            micro<MR, false>(kc, A, 1, MR, Bp, nr, C, ld);
          else
            micro<MR, true>(kc, A, 1, MR, Bp, nr, C, ld);
        }
      }
    }
    for (int64_t p = 0; p < np; ++p) softmax_panel(w, b, p, c, ce, st, m, l, al);
    for (int64_t q = 0; q < R; ++q) {
      if (al[q] == T(1)) continue;
      T* ar = acc + q * dvp;
      const T f = al[q];
      for (int64_t x = 0; x < dvp; x += N) vstore(ar + x, vload(ar + x) * f);
    }
    // acc += P V over the keys each row panel of queries reads; by value panel first, so
    // that the panel of V stays in L1 while the tile streams past
    for (int64_t dp = 0; dp < dvp; dp += nr) {
      for (int64_t q0 = 0; q0 < R; q0 += MR) {
        const int64_t k0 = std::max(c, rlo[q0 / MR]), k1 = std::min(ce, rhi[q0 / MR]);
        if (k0 >= k1) continue;
        micro_rows<true>(int(std::min<int64_t>(MR, R - q0)), k1 - k0, st + (k0 - c) * ld + q0, 1,
                         ld, vpanel(b, hkv, dp, k0), nr, acc + q0 * dvp + dp, dvp);
      }
    }
    if (vbad) {  // non-finite values (zeroed in the copy), added where the weight is not 0
      const uint8_t* bad = vbad + (b * P.Hkv + hkv) * P.Tk;
      for (int64_t j = c; j < ce; ++j) {
        if (!bad[j]) continue;
        const I* vr = Vv.row(b, hkv, j);
        for (int64_t q = 0; q < R; ++q) {
          const T pij = st[(j - c) * ld + q];
          if (pij == T(0)) continue;
          for (int64_t x = 0; x < P.dv; ++x) {
            const T vx = T(vr[x * Vv.s3]);
            if (!std::isfinite(vx)) acc[q * dvp + x] += pij * vx;
          }
        }
      }
    }
  }

  // The online softmax of panel p (NR query columns) over the tile's keys [c, ce), one
  // column panel at a time so that its statistics stay in registers: pass 1 applies the
  // modifiers and M and takes the column max; pass 2 turns scores into P = 2^(S - m) with
  // the column sums, then dropout. Keys the panel's columns may not read end as P = 0.
  __attribute__((noinline)) void softmax_panel(Work<T>& w, int64_t b, int64_t p, int64_t c, int64_t ce, T* st, T* m, T* l,
                     T* al) const {
    const Cols<T>& cols = w.cols;
    const int64_t ld = cols.ld, x0 = p * nr;
    const int64_t j_lo = std::max(c, cols.plo[p]), j_hi = std::min(ce, cols.phi[p]);
    T* bt = nullptr;
    if (P.bias && j_lo < j_hi)
      bias_block(P, cols, p, j_lo, j_hi, bt = scratch(w.bt, size_t((j_hi - j_lo) * nr)));
    const PanelMods<T> mods(P, cols, w.tk, b, p, !(cols.maxlo[p] <= c && cols.minhi[p] >= ce),
                            cap2, bt, j_lo);
    const bool* kp = P.key_padding ? P.key_padding + b * P.Tk : nullptr;
    V mt0 = vset<T>(NEG_INF<T>), mt1 = mt0;
    if (mods.block) mods.smod_block(st + (j_lo - c) * ld + x0, ld, j_lo, j_hi);
    mods.dispatch([&]<bool CAP, bool ALIBI, bool INTERVALS>() {
      for (int64_t j = j_lo; j < j_hi; ++j) {
        if (kp && !kp[j]) continue;
        T* x = st + (j - c) * ld + x0;
        mods.template apply<CAP, ALIBI, INTERVALS>(j, x, nullptr);
        mt0 = vmax(mt0, vload(x));
        mt1 = vmax(mt1, vload(x + N));
      }
    });
    // the new running max (m_safe: 0 where nothing was read yet), the rescale factors
    const V mo0 = vload(m + x0), mo1 = vload(m + x0 + N);
    const V mn0 = vmax(mo0, mt0), mn1 = vmax(mo1, mt1);
    const V ms0 = mn0 == NEG_INF<T> ? V{} : mn0, ms1 = mn1 == NEG_INF<T> ? V{} : mn1;
    const V a0 = exp2v(mo0 - ms0), a1 = exp2v(mo1 - ms1);
    V sum0 = V{}, sum1 = V{};
    for (int64_t j = c; j < ce; ++j) {
      T* x = st + (j - c) * ld + x0;
      if (j < j_lo || j >= j_hi || (kp && !kp[j])) {
        vstore(x, V{});
        vstore(x + N, V{});
        continue;
      }
      const V y0 = exp2v(vload(x) - ms0), y1 = exp2v(vload(x + N) - ms1);
      sum0 += y0;
      sum1 += y1;
      vstore(x, y0);
      vstore(x + N, y1);
      if (P.dropout) drop_cols(x, cols.rk.data() + x0, colkeys[j], P.drop_thr);
    }
    vstore(l + x0, vload(l + x0) * a0 + sum0);
    vstore(l + x0 + N, vload(l + x0 + N) * a1 + sum1);
    vstore(m + x0, mn0);
    vstore(m + x0 + N, mn1);
    vstore(al + x0, a0);
    vstore(al + x0 + N, a1);
  }

  // ---- decoding: rows along the lanes, K and V read in place ---------------------------
  void task_split(int64_t b, int64_t hkv, int64_t s, Work<T>& w) const {
    Cols<T>& cols = w.cols;
    columns(cols, b, hkv, 0, P.Tq);
    const int64_t R = cols.n;
    const int64_t k0 = P.Tk * s / splits, k1 = P.Tk * (s + 1) / splits;
    T* acc = scratch(w.acc, size_t(R * dvp));
    T* m = scratch(w.m, size_t(R));
    T* l = scratch(w.l, size_t(R));
    std::fill(acc, acc + R * dvp, T(0));
    std::fill(m, m + R, NEG_INF<T>);
    std::fill(l, l + R, T(0));
    const int64_t lo = std::max(k0, cols.klo), hi = std::min(k1, cols.khi);
    if (lo < hi) {
      T* qs = scratch(w.qs, size_t(R * P.dk));
      for (int64_t r = 0; r < R; ++r) {
        const I* src = Q.row(b, cols.head[r], cols.i[r]);
        for (int64_t x = 0; x < P.dk; ++x) qs[r * P.dk + x] = T(src[x * Q.s3]) * alpha;
      }
      T* S = scratch(w.st, size_t(hi - lo + N));
      for (int64_t r = 0; r < R; ++r) decode_row(w, b, hkv, r, lo, hi, qs, S, m, l, acc);
    }
    if (splits == 1) {  // nothing to merge
      finish(cols, b, m, l, acc, dvp);
      return;
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t row = (b * P.Hq + cols.head[r]) * P.Tq + cols.i[r];
      sm[row * splits + s] = m[r];
      sl[row * splits + s] = l[r];
      std::copy(acc + r * dvp, acc + (r + 1) * dvp, sacc + (row * splits + s) * dvp);
    }
  }

  // one query row over keys [k0, k1): scores, modifiers, M, softmax, dropout, values
  void decode_row(Work<T>& w, int64_t b, int64_t hkv, int64_t r, int64_t k0, int64_t k1,
                  const T* qs, T* S, T* m, T* l, T* acc) const {
    const Cols<T>& cols = w.cols;
    const int64_t s = std::max(k0, int64_t(cols.lo[r])), e = std::min(k1, int64_t(cols.hi[r]));
    if (s >= e) return;
    const int64_t h = cols.head[r], i = cols.i[r], n = e - s;
    const T* qr = qs + r * P.dk;
    for (int64_t j = s; j < e; ++j) {
      const I* kr = K.row(b, hkv, j);
      T a = 0;
      if constexpr (std::is_same_v<I, T>) {
        if (K.s3 == 1) {
          V va = V{};
          int64_t x = 0;
          for (; x + N <= P.dk; x += N) va += vload(qr + x) * vload(kr + x);
          a = hsum<T>(va);
          for (; x < P.dk; ++x) a += qr[x] * kr[x];
          S[j - s] = a;
          continue;
        }
      }
      for (int64_t x = 0; x < P.dk; ++x) a += qr[x] * T(kr[x * K.s3]);
      S[j - s] = a;
    }
    T mx = NEG_INF<T>;
    for (int64_t t = 0; t < n; ++t) {
      T x = S[t];
      if (cap2 != T(0)) x = T(std::tanh(double(x))) * cap2;
      if (P.slopes) x -= cols.slope[r] * std::abs(cols.pos[r] - T(P.k_start + s + t));
      if (P.rel) x += static_cast<const T*>(P.rel)[cols.roff[r] - (s + t)];
      if (P.bias)
        x += static_cast<const T*>(P.bias)[cols.boff[r] + (s + t) * P.bias_s[3]] * T(LOG2E);
      if (P.has_extra() && !P.allowed(b, h, i, s + t, P.kind(b, h, i / P.bq, (s + t) / P.bk)))
        x = NEG_INF<T>;
      S[t] = x;
      mx = x > mx ? x : mx;
    }
    const T m_new = mx > m[r] ? mx : m[r];
    const T safe = m_new == NEG_INF<T> ? T(0) : m_new;
    const T f = exp2s<T>(m[r] - safe);
    T sum = 0;
    {
      int64_t t = 0;
      V vs = V{};
      for (; t + N <= n; t += N) {
        V y = exp2v(vload(S + t) - safe);
        vstore(S + t, y);
        vs += y;
      }
      sum = hsum<T>(vs);
      for (; t < n; ++t) {
        S[t] = exp2s<T>(S[t] - safe);
        sum += S[t];
      }
    }
    l[r] = l[r] * f + sum;
    m[r] = m_new;
    T* ar = acc + r * dvp;
    if (f != T(1))
      for (int64_t x = 0; x < dvp; ++x) ar[x] *= f;
    if (P.dropout)
      for (int64_t t = 0; t < n; ++t)
        if ((fmix32(cols.rk[r] ^ colkeys[s + t]) >> 8) < P.drop_thr) S[t] = T(0);
    for (int64_t j = s; j < e; ++j) {
      const T pij = S[j - s];
      if (pij == T(0)) continue;  // a zero weight never meets its value (NaN, inf)
      const I* vr = Vv.row(b, hkv, j);
      if constexpr (std::is_same_v<I, T>) {
        if (Vv.s3 == 1) {
          int64_t x = 0;
          for (; x + N <= P.dv; x += N) vstore(ar + x, vload(ar + x) + pij * vload(vr + x));
          for (; x < P.dv; ++x) ar[x] += pij * vr[x];
          continue;
        }
      }
      for (int64_t x = 0; x < P.dv; ++x) ar[x] += pij * T(vr[x * Vv.s3]);
    }
  }

  // the splits of (b, kv head) merged in split order, then finished
  void merge(int64_t b, int64_t hkv, Work<T>& w) const {
    Cols<T>& cols = w.cols;
    columns(cols, b, hkv, 0, P.Tq);
    const int64_t R = cols.n;
    T* acc = scratch(w.acc, size_t(R * dvp));
    T* m = scratch(w.m, size_t(R));
    T* l = scratch(w.l, size_t(R));
    for (int64_t r = 0; r < R; ++r) {
      const int64_t row = (b * P.Hq + cols.head[r]) * P.Tq + cols.i[r];
      T M = NEG_INF<T>;
      for (int64_t s = 0; s < splits; ++s) M = std::max(M, sm[row * splits + s]);
      m[r] = M;
      l[r] = 0;
      T* ar = acc + r * dvp;
      std::fill(ar, ar + dvp, T(0));
      for (int64_t s = 0; s < splits; ++s) {
        const T ls = sl[row * splits + s];
        if (ls == T(0)) continue;
        const T f = exp2s<T>(sm[row * splits + s] - M);
        l[r] += ls * f;
        const T* src = sacc + (row * splits + s) * dvp;
        for (int64_t x = 0; x < dvp; ++x) ar[x] += src[x] * f;
      }
    }
    finish(cols, b, m, l, acc, dvp);
  }
};

template <typename T>
Work<T>& thread_work() {
  thread_local Work<T> w;
  return w;
}

template <typename I, typename T>
void run(const Problem& P, const Options& o, at::Tensor& out, at::Tensor& lse) {
  Forward<I, T> f(P, o.bq, o.bk, static_cast<I*>(out.data_ptr()), lse.data_ptr<T>());
  const int64_t work = P.B * P.Hq * P.Tq * P.Tk * (P.dk + P.dv);
  if (o.decode) {
    f.splits = o.splits;
    const int64_t n = P.B * P.Hkv * o.splits;
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    if (o.splits == 1) {
      run_tasks(order, work, [&](int64_t t, int64_t) {
        f.task_split(t / P.Hkv, t % P.Hkv, 0, thread_work<T>());
      });
      return;
    }
    const int64_t rows = P.B * P.Hq * P.Tq;
    at::Tensor part = at::empty({rows * o.splits * (2 + f.dvp)},
                                at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
    f.sm = part.data_ptr<T>();
    f.sl = f.sm + rows * o.splits;
    f.sacc = f.sl + rows * o.splits;
    run_tasks(order, work, [&](int64_t t, int64_t) {
      f.task_split(t / (P.Hkv * o.splits), (t / o.splits) % P.Hkv, t % o.splits,
                   thread_work<T>());
    });
    std::vector<int64_t> heads(P.B * P.Hkv);
    std::iota(heads.begin(), heads.end(), 0);
    run_tasks(heads, work, [&](int64_t t, int64_t) {
      f.merge(t / P.Hkv, t % P.Hkv, thread_work<T>());
    });
    return;
  }
  f.prepare();
  const int64_t nqb = (P.Tq + o.bq - 1) / o.bq;
  const int64_t n = P.B * P.Hkv * nqb;
  std::vector<int64_t> cost(n);
  for (int64_t t = 0; t < n; ++t) {  // the keys its rows read
    const int64_t b = t / (P.Hkv * nqb), qb = t % nqb;
    const int64_t *lo = P.lo_row(b), *hi = P.hi_row(b);
    int64_t c = 0;
    for (int64_t i = qb * o.bq; i < std::min(P.Tq, (qb + 1) * o.bq); ++i) c += hi[i] - lo[i];
    cost[t] = c;
  }
  run_tasks(by_cost(cost), work, [&](int64_t t, int64_t) {
    f.task_block(t / (P.Hkv * nqb), (t / nqb) % P.Hkv, t % nqb, thread_work<T>());
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> forward(const Problem& P, const Options& o) {
  const bool f64 = P.dtype == at::kDouble;
  at::Tensor out = at::empty({P.B, P.Hq, P.Tq, P.dv}, P.q.options());
  at::Tensor lse =
      at::empty({P.B, P.Hq, P.Tq}, P.q.options().dtype(f64 ? at::kDouble : at::kFloat));
  if (out.numel() == 0 || P.Tk == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<double>::infinity());
    return {out, lse};
  }
  switch (P.dtype) {
    case at::kFloat: run<float, float>(P, o, out, lse); break;
    case at::kDouble: run<double, double>(P, o, out, lse); break;
    case at::kBFloat16: run<c10::BFloat16, float>(P, o, out, lse); break;
    case at::kHalf: run<c10::Half, float>(P, o, out, lse); break;
    default: TORCH_CHECK(false, "causalattn cpp: unsupported dtype ", P.dtype);
  }
  return {out, lse};
}

}  // namespace causalattn
