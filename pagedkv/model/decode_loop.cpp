// The decoder layers of one pure-decode step in one call (torch.ops.pagedkv_ops.decode_layers):
// the ops LlamaModel.forward's layer loop calls, in its order, on its tensors, with no Python
// between them. Each op is the registered one, called through the dispatcher (the attention
// op lives in another library), so every output is bit for bit the loop's.
//
// At one row a 28-layer model's loop made ~250 op calls a step; their Python (argument
// parsing, the wrappers, the loop) cost ~1.5-2 ms of a 32 ms step, single-threaded while the
// second OpenMP thread waited.
//
// decode_layers(x, h, bufs, rope, meta, caches, w, ints, floats):
//   x [T, H] the residual stream (updated in place), h [T, H] layer 0's normed input (the
//   step's normed-state buffer: every add_rms_norm writes it);
//   bufs: qk [T, Hq + Hkv, D], att [T, Hq, D], act [T, I], qkv [T, (Hq + 2 Hkv) D], o [T, H],
//     gate_up [T, 2 I], down [T, H], then the views qk_in (q|k of qkv), q, k (of qk), v (of
//     qkv), att2 (att as [T, Hq D]);
//   rope: cos, sin of each RoPE table; meta: slots, block tables, seq lens of each KV group;
//   caches: each layer's k cache and v cache;
//   w, per layer: post-attention norm, next layer's input norm (all but the last), qkv bias
//     (when it has one), the QK-norm weights [Hq + Hkv, D] (Qwen3, Gemma 3: when it has them),
//     the attention and MLP output norms (Gemma's: when it has them), then the tensors of its
//     four matmuls (qkv, o, gate_up, down: QWeight.step_call);
//   ints: layers, gelu, then per layer: group, rope table, window, bias, QK-norm, output norms
//     (each flag 0 or 1), then per matmul kind, count of tensors, count of ints, the ints
//     (QWeight.step_call's);
//   floats: eps, attention scale, softcap.
// The caller (LlamaModel._decode_plan) builds these only where every step of the loop is one
// of these ops; anything else runs the Python loop.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/rms_norm.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

using at::Tensor;
using c10::IntArrayRef;
using c10::TypedOperatorHandle;

template <class F>
TypedOperatorHandle<F> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

struct Ops {
  TypedOperatorHandle<void(const Tensor&, at::TensorList, IntArrayRef, Tensor&, int64_t)> a8, panel;
  TypedOperatorHandle<void(const Tensor&, at::TensorList, IntArrayRef, IntArrayRef, Tensor&)> r16;
  TypedOperatorHandle<void(const Tensor&, const Tensor&, int64_t, Tensor&, int64_t)> rows, gemm;
  TypedOperatorHandle<void(Tensor&, const Tensor&, const Tensor&, double, Tensor&)> add_norm;
  TypedOperatorHandle<void(Tensor&, const Tensor&, const Tensor&, const Tensor&, double, Tensor&)> norm_add;
  TypedOperatorHandle<void(const Tensor&, Tensor&)> silu, gelu;
  TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, Tensor&)> rope;
  TypedOperatorHandle<void(const Tensor&, const Tensor&, double, const Tensor&, const Tensor&, Tensor&)> norm_rope;
  TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&,
                           const Tensor&, const Tensor&, double, Tensor&, int64_t, double)>
      write_decode;
  Ops()
      : a8(op<void(const Tensor&, at::TensorList, IntArrayRef, Tensor&, int64_t)>("pagedkv_a8::linear")),
        panel(op<void(const Tensor&, at::TensorList, IntArrayRef, Tensor&, int64_t)>("pagedkv_a8::panel")),
        r16(op<void(const Tensor&, at::TensorList, IntArrayRef, IntArrayRef, Tensor&)>("pagedkv_a8::panel_r16")),
        rows(op<void(const Tensor&, const Tensor&, int64_t, Tensor&, int64_t)>("pagedkv_q::qmatmul")),
        gemm(op<void(const Tensor&, const Tensor&, int64_t, Tensor&, int64_t)>("pagedkv_q::qgemm")),
        add_norm(op<void(Tensor&, const Tensor&, const Tensor&, double, Tensor&)>("pagedkv_ops::add_rms_norm")),
        norm_add(op<void(Tensor&, const Tensor&, const Tensor&, const Tensor&, double, Tensor&)>(
            "pagedkv_ops::norm_add_rms_norm")),
        silu(op<void(const Tensor&, Tensor&)>("pagedkv_ops::silu_mul")),
        gelu(op<void(const Tensor&, Tensor&)>("pagedkv_ops::gelu_tanh_mul")),
        rope(op<void(const Tensor&, const Tensor&, const Tensor&, Tensor&)>("pagedkv_ops::rope")),
        norm_rope(op<void(const Tensor&, const Tensor&, double, const Tensor&, const Tensor&, Tensor&)>(
            "pagedkv_ops::norm_rope")),
        write_decode(op<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&,
                             const Tensor&, const Tensor&, double, Tensor&, int64_t, double)>(
            "pagedkv_attn::write_decode")) {}
};

const Ops& ops() {
  static const Ops o;  // (the attention library is loaded before the first call: the caller checks)
  return o;
}

// a cursor over the plan's tensors and ints; every read is bounds-checked
struct Reader {
  at::TensorList w;
  IntArrayRef ints;
  size_t wi = 0, ii = 0;
  const Tensor& tensor() {
    TORCH_CHECK(wi < w.size(), "decode_layers: the plan ran out of tensors");
    return w[wi++];
  }
  at::TensorList tensors(int64_t n) {
    TORCH_CHECK(n >= 0 && wi + static_cast<size_t>(n) <= w.size(), "decode_layers: the plan ran out of tensors");
    const at::TensorList out = w.slice(wi, n);
    wi += n;
    return out;
  }
  int64_t next() {
    TORCH_CHECK(ii < ints.size(), "decode_layers: the plan ran out of ints");
    return ints[ii++];
  }
  IntArrayRef span(int64_t n) {
    TORCH_CHECK(n >= 0 && ii + static_cast<size_t>(n) <= ints.size(), "decode_layers: the plan ran out of ints");
    const IntArrayRef out = ints.slice(ii, n);
    ii += n;
    return out;
  }
};

// one matmul: out = x W^T by the op QWeight.linear takes for these rows (Run = false: only
// read and check its part of the plan)
template <bool Run>
void matmul(const Ops* o, Reader& r, const Tensor& x, Tensor& out) {
  const int64_t kind = r.next(), nt = r.next(), ni = r.next();
  const at::TensorList ws = r.tensors(nt);
  const IntArrayRef v = r.span(ni);
  TORCH_CHECK(kind >= 0 && kind <= 4 && nt > 0, "decode_layers: unknown matmul kind ", kind);
  TORCH_CHECK(kind > 1 || ni == nt + 1, "decode_layers: an int8 matmul takes its impl and one type a segment");
  TORCH_CHECK(kind < 2 || ni == 2 * nt, "decode_layers: two ints a segment");
  if constexpr (Run) {
    if (kind < 2) (kind == 0 ? o->a8 : o->panel).call(x, ws, v.slice(1), out, v[0]);
    else if (kind == 2) o->r16.call(x, ws, v.slice(0, nt), v.slice(nt), out);
    else
      for (int64_t i = 0; i < nt; ++i) (kind == 3 ? o->rows : o->gemm).call(x, ws[i], v[2 * i], out, v[2 * i + 1]);
  }
}

// the layers (Run = false: a pass that reads and checks the whole plan and calls nothing, so
// that a malformed plan fails before the first op changes x or a cache)
template <bool Run>
void layers(const Ops* o, Tensor& x, Tensor& h, at::TensorList bufs, at::TensorList rope, at::TensorList meta,
            at::TensorList caches, at::TensorList w, IntArrayRef ints, at::ArrayRef<double> floats) {
  Tensor qk = bufs[0], att = bufs[1], act = bufs[2], qkv = bufs[3], ob = bufs[4], gu = bufs[5], down = bufs[6];
  const Tensor &qk_in = bufs[7], &q = bufs[8], &k = bufs[9], &v = bufs[10], &att2 = bufs[11];
  const double eps = floats[0], scale = floats[1], softcap = floats[2];
  Reader r{w, ints};
  const int64_t n = r.next(), gelu = r.next();
  // (counts and indices compared by division: a hostile int never overflows into range)
  TORCH_CHECK(n > 0 && caches.size() % 2 == 0 && n == static_cast<int64_t>(caches.size() / 2),
              "decode_layers: a k and a v cache a layer");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t group = r.next(), table = r.next(), window = r.next(), bias = r.next(), qkn = r.next(),
                  outn = r.next();
    TORCH_CHECK(group >= 0 && group < static_cast<int64_t>(meta.size() / 3), "decode_layers: no KV group ", group);
    TORCH_CHECK(table >= 0 && table < static_cast<int64_t>(rope.size() / 2), "decode_layers: no RoPE table ", table);
    TORCH_CHECK(window >= 0, "decode_layers: window ", window, " < 0");
    TORCH_CHECK((bias == 0 || bias == 1) && (qkn == 0 || qkn == 1) && (outn == 0 || outn == 1),
                "decode_layers: a layer's bias, QK-norm and output-norm flags are 0 or 1");
    const Tensor& post_norm = r.tensor();
    const Tensor* next_norm = i + 1 < n ? &r.tensor() : nullptr;
    const Tensor* b = bias ? &r.tensor() : nullptr;
    const Tensor* qk_w = qkn ? &r.tensor() : nullptr;
    const Tensor* attn_out = outn ? &r.tensor() : nullptr;
    const Tensor* mlp_out = outn ? &r.tensor() : nullptr;
    TORCH_CHECK(!qk_w || (qk_w->dim() == 2 && qk_w->size(0) == qk_in.size(1) && qk_w->size(1) == qk_in.size(2)),
                "decode_layers: QK-norm weights must be [Hq + Hkv, D]");
    TORCH_CHECK(!outn || (attn_out->dim() == 1 && mlp_out->dim() == 1 && attn_out->size(0) == x.size(1) &&
                          mlp_out->size(0) == x.size(1)),
                "decode_layers: output norms must be [H]");
    Tensor kc = caches[2 * i], vc = caches[2 * i + 1];
    matmul<Run>(o, r, h, qkv);
    if constexpr (Run) {
      if (b) qkv.add_(*b);
      if (qk_w)  // each q and k head RMS-normed, then RoPE (QK-norm)
        o->norm_rope.call(qk_in, *qk_w, eps, rope[2 * table], rope[2 * table + 1], qk);
      else
        o->rope.call(qk_in, rope[2 * table], rope[2 * table + 1], qk);
      o->write_decode.call(q, k, v, meta[3 * group], kc, vc, meta[3 * group + 1], meta[3 * group + 2], scale, att,
                           window, softcap);
    }
    matmul<Run>(o, r, att2, ob);
    if constexpr (Run) {  // (Gemma: each output normed before its residual add)
      if (attn_out) o->norm_add.call(x, ob, *attn_out, post_norm, eps, h);
      else o->add_norm.call(x, ob, post_norm, eps, h);
    }
    matmul<Run>(o, r, h, gu);
    if constexpr (Run) (gelu ? o->gelu : o->silu).call(gu, act);
    matmul<Run>(o, r, act, down);
    if constexpr (Run) {
      if (next_norm && mlp_out) o->norm_add.call(x, down, *mlp_out, *next_norm, eps, h);
      else if (next_norm) o->add_norm.call(x, down, *next_norm, eps, h);
      else if (mlp_out) x.add_(at::rms_norm(down, {down.size(-1)}, *mlp_out, eps));
      else x.add_(down);
    }
  }
  TORCH_CHECK(r.wi == w.size() && r.ii == ints.size(), "decode_layers: the plan has more than its layers");
}

void decode_layers(Tensor& x, Tensor& h, at::TensorList bufs, at::TensorList rope, at::TensorList meta,
                   at::TensorList caches, at::TensorList w, IntArrayRef ints, at::ArrayRef<double> floats) {
  TORCH_CHECK(bufs.size() == 12, "decode_layers: 12 step buffers and views");
  TORCH_CHECK(floats.size() == 3, "decode_layers: eps, scale, softcap");
  TORCH_CHECK(std::isfinite(floats[0]) && floats[0] >= 0 && std::isfinite(floats[1]) && std::isfinite(floats[2]) &&
                  floats[2] >= 0,
              "decode_layers: eps and softcap must be finite and >= 0, the scale finite");
  layers<false>(nullptr, x, h, bufs, rope, meta, caches, w, ints, floats);
  layers<true>(&ops(), x, h, bufs, rope, meta, caches, w, ints, floats);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv_ops, m) {
  m.def("decode_layers(Tensor(a!) x, Tensor(b!) h, Tensor[] bufs, Tensor[] rope, Tensor[] meta, Tensor[] caches, "
        "Tensor[] w, int[] ints, float[] floats) -> ()");
}

TORCH_LIBRARY_IMPL(pagedkv_ops, CPU, m) { m.impl("decode_layers", &decode_layers); }
