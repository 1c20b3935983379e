// The native engine's two entry points, fwd and bwd, bound with pybind11 (a call costs
// well under a microsecond; the dispatcher would cost several), each taking its tensors and
// one Call (the rest, by name). Python
// (causalattn/engines/cpp.py) has checked every argument and derived the pattern's data
// from causalattn.masks.Pattern before any of this runs; the checks here only guard the
// memory the kernels read.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include "problem.h"

namespace causalattn {

std::tuple<at::Tensor, at::Tensor> forward(const Problem& P, const Options& o);
// (dq, dk, dv, d slopes (1|B, H_q), d bias (bias's 4-D shape), d rel_bias (H_q, R)); the last
// three empty unless asked for by o.want
std::vector<at::Tensor> backward(const Problem& P, const Options& o, const at::Tensor& out,
                                 const at::Tensor& dout, const at::Tensor& lse,
                                 const std::optional<at::Tensor>& dlse);

// Everything of one call but its tensors q, k, v (and the backward's out, dout, lse, dlse),
// by name: the pattern's data, the modifiers, dropout, the blocks, the score_mod's program.
// Python (causalattn/engines/cpp.py) sets the fields a call needs; the others keep these
// defaults (none, off).
struct Call {
  at::Tensor lo, hi;  // readable intervals lo <= j < hi, int64 (1|B, T_q)
  std::optional<at::Tensor> key_padding, kinds, mask, tile_masks, slopes, sinks, bias, rel;
  double scale = 1, softcap = 0;
  int64_t q_start = 0, k_start = 0;
  int64_t drop_thr = 0, seed = 0, offset = 0;  // drop_thr 0: no dropout
  double drop_scale = 1;
  int64_t bq = 0, bk = 0;  // the forward's blocks, the grid of kinds
  int64_t splits = 1;  // forward: key splits when decoding
  bool decode = false;
  int64_t bwd_q = 0, bwd_k = 0, lanes = 1, want = 0;  // backward: blocks, lanes, WANT_* bits
  std::optional<at::Tensor> smod_code, smod_consts, smod_data, smod_meta;  // null: none
  int64_t smod_out = 0, smod_regs = 0, smod_grad = 0;
};

namespace {

// broadcast stride of axis `d`: 0 when the axis has size 1
int64_t bstride(const at::Tensor& t, int64_t d) { return t.size(d) > 1 ? t.stride(d) : 0; }

void check(bool ok, const char* what) { TORCH_CHECK(ok, "causalattn cpp: ", what); }

// The score_mod's program (causalattn/engines/score_program.py) onto P; code null: none.
void set_smod(Problem& P, const Call& c, int64_t grad, int* bad) {
  const std::optional<at::Tensor>&code = c.smod_code, &consts = c.smod_consts,
                                  &data = c.smod_data, &meta = c.smod_meta;
  const int64_t out = c.smod_out, regs = c.smod_regs;
  if (!code) return;
  const at::ScalarType ct = P.dtype == at::kDouble ? at::kDouble : at::kFloat;
  check(code->scalar_type() == at::kLong && code->is_contiguous() && code->dim() == 2 &&
            code->size(1) == SMOD_COLS,
        "score_mod code must be contiguous int64 (n, 8)");
  check(consts && consts->scalar_type() == at::kDouble && consts->is_contiguous(),
        "score_mod constants must be contiguous float64");
  check(data && data->scalar_type() == ct && data->is_contiguous(),
        "score_mod tables must be contiguous in the compute type");
  check(data->numel() < (int64_t(1) << 31), "score_mod tables: fewer than 2^31 elements");
  check(meta && meta->scalar_type() == at::kLong && meta->is_contiguous() && meta->dim() == 2 &&
            meta->size(1) == SMOD_META,
        "score_mod table data must be int64 (tables, 10)");
  check(regs > 4 && regs <= 64 && out >= 0 && out < regs, "score_mod registers");
  const int64_t* ops = code->data_ptr<int64_t>();
  const int64_t n = code->size(0), ntab = meta->size(0);
  const int64_t* m = meta->data_ptr<int64_t>();
  for (int64_t t = 0; t < ntab; ++t) {  // every element a table's index can reach is inside
    const int64_t* mt = m + t * SMOD_META;
    int64_t last = mt[0];
    check(mt[1] >= 0 && mt[1] <= 4, "score_mod table dims");
    for (int64_t d = 0; d < mt[1]; ++d) last += (mt[2 + d] - 1) * mt[6 + d];
    check(mt[0] >= 0 && last < data->numel() && (mt[1] > 0 || mt[0] < data->numel()),
          "score_mod table bounds");
  }
  for (int64_t k = 0; k < n; ++k) {
    const int64_t* r = ops + k * SMOD_COLS;
    check(r[0] >= OP_CONST && r[0] <= OP_MOD && r[1] >= 5 && r[1] < regs, "score_mod op");
    for (int a = 2; a < 6; ++a) check(r[a] >= -1 && r[a] < regs, "score_mod operand");
    if (r[0] == OP_CONST || r[0] == OP_POW) check(r[6] >= 0 && r[6] < consts->numel(), "const");
    if (r[0] == OP_GATHER) {
      check(r[6] >= 0 && r[6] < ntab, "score_mod table");
      for (int64_t d = 0; d < m[r[6] * SMOD_META + 1]; ++d) check(r[2 + d] >= 0, "index");
    }
  }
  P.smod.code = ops;
  P.smod.n = n;
  P.smod.regs = regs;
  P.smod.out = out;
  P.smod.consts = consts->data_ptr<double>();
  P.smod.data = data->data_ptr();
  P.smod.meta = m;
  P.smod.ntab = ntab;
  P.smod.numel = data->numel();
  P.smod.grad = grad;
  P.smod.bad = bad;
}

}  // namespace

Problem make_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const Call& c) {
  const at::Tensor &lo = c.lo, &hi = c.hi;
  const std::optional<at::Tensor>&key_padding = c.key_padding, &kinds = c.kinds,
                                  &mask = c.mask, &tile_masks = c.tile_masks,
                                  &slopes = c.slopes, &sinks = c.sinks, &bias = c.bias,
                                  &rel = c.rel;
  const int64_t bq = c.bq, bk = c.bk, q_start = c.q_start, k_start = c.k_start;
  check(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D");
  check(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  check(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "dtypes");
  Problem P;
  P.q = q;
  P.k = k;
  P.v = v;
  P.dtype = q.scalar_type();
  P.B = q.size(0);
  P.Hq = q.size(1);
  P.Tq = q.size(2);
  P.dk = q.size(3);
  P.Hkv = k.size(1);
  P.Tk = k.size(2);
  P.dv = v.size(3);
  check(P.Hkv > 0 && P.Hq % P.Hkv == 0, "H_q must be a multiple of H_kv");
  P.g = P.Hq / P.Hkv;
  check(k.size(0) == P.B && v.size(0) == P.B && k.size(3) == P.dk, "q, k shapes");
  check(v.size(1) == P.Hkv && v.size(2) == P.Tk, "k, v shapes");
  check(lo.scalar_type() == at::kLong && hi.scalar_type() == at::kLong, "lo, hi int64");
  check(lo.is_contiguous() && hi.is_contiguous() && lo.sizes() == hi.sizes(), "lo, hi layout");
  check(lo.dim() == 2 && lo.size(1) == P.Tq && (lo.size(0) == 1 || lo.size(0) == P.B),
        "lo, hi must be (1 or B, T_q)");
  P.lo = lo.data_ptr<int64_t>();
  P.hi = hi.data_ptr<int64_t>();
  P.lo_b = lo.size(0) > 1 ? P.Tq : 0;
  check(bq > 0 && bk > 0 && bk % NR<float> == 0 && bk % NR<double> == 0 && bk % MR == 0,
        "block sizes: bk a multiple of the micro-kernel's rows and columns");
  P.bq = bq;
  P.bk = bk;
  if (key_padding) {
    const at::Tensor& t = *key_padding;
    check(t.scalar_type() == at::kBool && t.is_contiguous() && t.dim() == 2 &&
              t.size(0) == P.B && t.size(1) == P.Tk,
          "key_padding must be contiguous bool (B, T_k)");
    P.key_padding = t.data_ptr<bool>();
  }
  if (kinds) {
    const at::Tensor& t = *kinds;
    P.nQB = (P.Tq + bq - 1) / bq;
    P.nKB = (P.Tk + bk - 1) / bk;
    check(t.scalar_type() == at::kInt && t.is_contiguous() && t.dim() == 4 &&
              (t.size(0) == 1 || t.size(0) == P.B) && (t.size(1) == 1 || t.size(1) == P.Hq) &&
              t.size(2) == P.nQB && t.size(3) == P.nKB,
          "kinds must be contiguous int32 (1|B, 1|H_q, nQB, nKB)");
    P.kinds = t.data_ptr<int32_t>();
    P.kinds_b = bstride(t, 0);
    P.kinds_h = bstride(t, 1);
    const int32_t* kd = t.data_ptr<int32_t>();
    const int32_t top = t.numel() ? *std::max_element(kd, kd + t.numel()) : 0;
    check(top < PARTIAL_DENSE || top > PARTIAL_DENSE || mask.has_value(), "kinds need a mask");
    if (top >= PARTIAL_TILE) {
      check(tile_masks.has_value() && tile_masks->scalar_type() == at::kBool &&
                tile_masks->is_contiguous() && tile_masks->dim() == 3 &&
                tile_masks->size(0) > top - PARTIAL_TILE && tile_masks->size(1) == bq &&
                tile_masks->size(2) == bk,
            "tile_masks must be contiguous bool (n, bq, bk) covering every kind");
      P.tile_masks = tile_masks->data_ptr<bool>();
    }
  }
  if (mask) {
    const at::Tensor& t = *mask;
    check(t.scalar_type() == at::kBool && t.is_contiguous() && t.dim() == 4 &&
              (t.size(0) == 1 || t.size(0) == P.B) && (t.size(1) == 1 || t.size(1) == P.Hq) &&
              t.size(2) == P.Tq && t.size(3) == P.Tk,
          "mask must be contiguous bool (1|B, 1|H_q, T_q, T_k)");
    P.mask = t.data_ptr<bool>();
    P.mask_b = bstride(t, 0);
    P.mask_h = bstride(t, 1);
  }
  if (slopes) {
    const at::Tensor& t = *slopes;
    check(t.scalar_type() == at::kDouble && t.is_contiguous() && t.dim() == 2 &&
              (t.size(0) == 1 || t.size(0) == P.B) && t.size(1) == P.Hq,
          "slopes must be contiguous float64 (1|B, H_q)");
    P.slopes = t.data_ptr<double>();
    P.slopes_b = bstride(t, 0);
  }
  if (sinks) {
    const at::Tensor& t = *sinks;
    check(t.scalar_type() == at::kDouble && t.is_contiguous() && t.numel() == P.Hq,
          "sinks must be contiguous float64 (H_q,)");
    P.sinks = t.data_ptr<double>();
  }
  const at::ScalarType ct = P.dtype == at::kDouble ? at::kDouble : at::kFloat;
  if (bias) {
    const at::Tensor& t = *bias;
    check(t.scalar_type() == ct && t.dim() == 4 && (t.size(0) == 1 || t.size(0) == P.B) &&
              (t.size(1) == 1 || t.size(1) == P.Hq) && (t.size(2) == 1 || t.size(2) == P.Tq) &&
              (t.size(3) == 1 || t.size(3) == P.Tk),
          "bias must be 4-D in the compute type, (1|B, 1|H_q, 1|T_q, 1|T_k)");
    P.bias = t.data_ptr();
    for (int d = 0; d < 4; ++d) P.bias_s[d] = bstride(t, d);
    P.bias_sizes = t.sizes().vec();
  }
  if (rel) {
    const at::Tensor& t = *rel;
    check(t.scalar_type() == ct && t.is_contiguous() && t.dim() == 2 && t.size(0) == P.Hq &&
              t.size(1) > 2 * REL_PAD,
          "rel_bias must be contiguous (H_q, R + 2·pad) in the compute type");
    const int64_t R = t.size(1) - 2 * REL_PAD, c = (R - 1) / 2;
    check(c + k_start - (q_start + P.Tq - 1) >= 0 && c + k_start + P.Tk - 1 - q_start < R,
          "rel_bias is too narrow for these positions");
    P.rel = t.data_ptr();
    P.rel_ld = t.size(1);
  }
  P.scale = c.scale;
  P.softcap = c.softcap;
  P.q_start = q_start;
  P.k_start = k_start;
  P.drop_thr = uint32_t(c.drop_thr);
  P.dropout = c.drop_thr > 0;
  P.drop_scale = c.drop_scale;
  P.seed = uint32_t(c.seed);
  P.offset = uint32_t(c.offset);
  return P;
}

std::tuple<at::Tensor, at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const Call& c) {
  Problem P = make_problem(q, k, v, c);
  int bad = 0;
  set_smod(P, c, 0, &bad);
  check(!(c.decode && P.smod.on()), "a score_mod runs on blocks, not the decoding path");
  check(!c.decode || P.Tq <= c.bq, "decoding needs T_q <= bq");
  check(c.splits >= 1, "splits");
  Options o{c.bq, c.bk, c.splits, 1, c.decode};
  auto res = forward(P, o);
  TORCH_CHECK(!bad, "score_mod: a captured tensor was indexed out of range at a readable cell");
  return res;
}

std::vector<at::Tensor> bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& out, const at::Tensor& dout, const at::Tensor& lse,
                            const std::optional<at::Tensor>& dlse, const Call& c) {
  Problem P = make_problem(q, k, v, c);
  int bad = 0;
  set_smod(P, c, c.smod_grad, &bad);
  const int64_t bwd_q = c.bwd_q, bwd_k = c.bwd_k, lanes = c.lanes, want = c.want;
  check(out.sizes() == dout.sizes() && out.dim() == 4 && out.size(0) == P.B &&
            out.size(1) == P.Hq && out.size(2) == P.Tq && out.size(3) == P.dv,
        "out, dout must be (B, H_q, T_q, d_v)");
  check(out.scalar_type() == P.dtype && dout.scalar_type() == P.dtype, "out, dout dtype");
  check(lse.numel() == P.B * P.Hq * P.Tq, "lse must be (B, H_q, T_q)");
  check(!dlse || dlse->numel() == P.B * P.Hq * P.Tq, "dlse must be (B, H_q, T_q)");
  check(bwd_k > 0 && bwd_k % NR<float> == 0 && c.bk % bwd_k == 0, "backward key block");
  check(bwd_q > 0 && lanes >= 1, "backward query block, lanes");
  check(!(want & WANT_SLOPES) || P.slopes, "slope gradients need slopes");
  check(!(want & WANT_REL) || P.rel, "rel_bias gradients need rel_bias");
  Options o{bwd_q, bwd_k, 1, lanes, false, want};
  auto res = backward(P, o, out, dout, lse.reshape({P.B, P.Hq, P.Tq}), dlse);
  TORCH_CHECK(!bad, "score_mod: a captured tensor was indexed out of range at a readable cell");
  return res;
}

}  // namespace causalattn

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using causalattn::Call;
  py::class_<Call>(m, "Call", "Everything of one call but its tensors, by name (csrc/ops.cpp)")
      .def(py::init<>())
      .def_readwrite("lo", &Call::lo)
      .def_readwrite("hi", &Call::hi)
      .def_readwrite("key_padding", &Call::key_padding)
      .def_readwrite("kinds", &Call::kinds)
      .def_readwrite("mask", &Call::mask)
      .def_readwrite("tile_masks", &Call::tile_masks)
      .def_readwrite("slopes", &Call::slopes)
      .def_readwrite("sinks", &Call::sinks)
      .def_readwrite("bias", &Call::bias)
      .def_readwrite("rel", &Call::rel)
      .def_readwrite("scale", &Call::scale)
      .def_readwrite("softcap", &Call::softcap)
      .def_readwrite("q_start", &Call::q_start)
      .def_readwrite("k_start", &Call::k_start)
      .def_readwrite("drop_thr", &Call::drop_thr)
      .def_readwrite("drop_scale", &Call::drop_scale)
      .def_readwrite("seed", &Call::seed)
      .def_readwrite("offset", &Call::offset)
      .def_readwrite("bq", &Call::bq)
      .def_readwrite("bk", &Call::bk)
      .def_readwrite("splits", &Call::splits)
      .def_readwrite("decode", &Call::decode)
      .def_readwrite("bwd_q", &Call::bwd_q)
      .def_readwrite("bwd_k", &Call::bwd_k)
      .def_readwrite("lanes", &Call::lanes)
      .def_readwrite("want", &Call::want)
      .def_readwrite("smod_code", &Call::smod_code)
      .def_readwrite("smod_consts", &Call::smod_consts)
      .def_readwrite("smod_data", &Call::smod_data)
      .def_readwrite("smod_meta", &Call::smod_meta)
      .def_readwrite("smod_out", &Call::smod_out)
      .def_readwrite("smod_regs", &Call::smod_regs)
      .def_readwrite("smod_grad", &Call::smod_grad);
  m.def("fwd", &causalattn::fwd, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("call"),
        "(out, lse) of q, k, v and the call's pattern and options");
  m.def("bwd", &causalattn::bwd, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("dout"), py::arg("lse"), py::arg("dlse"), py::arg("call"),
        "[dq, dk, dv, dslopes, dz, drel, dtables] from the given out and lse");
  // the layout constants Python builds arguments by (problem.h is their one source)
  m.attr("REL_PAD") = causalattn::REL_PAD;
  m.attr("WANT_SLOPES") = static_cast<int64_t>(causalattn::WANT_SLOPES);
  m.attr("WANT_BIAS") = static_cast<int64_t>(causalattn::WANT_BIAS);
  m.attr("WANT_REL") = static_cast<int64_t>(causalattn::WANT_REL);
  // what it was compiled with of causalattn/constants.py's (checked against them at load)
  m.attr("LOG2E") = causalattn::LOG2E;
  m.attr("LN2") = causalattn::LN2;
  m.attr("HASH_C1") = static_cast<int64_t>(causalattn::HASH_C1);
  m.attr("HASH_C2") = static_cast<int64_t>(causalattn::HASH_C2);
  m.attr("HASH_GOLD") = static_cast<int64_t>(causalattn::HASH_GOLD);
  m.attr("HASH_ROW") = static_cast<int64_t>(causalattn::HASH_ROW);
  m.attr("HASH_COL") = static_cast<int64_t>(causalattn::HASH_COL);
  m.attr("HASH_OFFSET") = static_cast<int64_t>(causalattn::HASH_OFFSET);
  m.attr("SKIP") = static_cast<int64_t>(causalattn::SKIP);
  m.attr("FULL") = static_cast<int64_t>(causalattn::FULL);
  m.attr("PARTIAL_DENSE") = static_cast<int64_t>(causalattn::PARTIAL_DENSE);
  m.attr("PARTIAL_TILE") = static_cast<int64_t>(causalattn::PARTIAL_TILE);
}
