// The host loops of Muon::step (see host_ops.h).
#include "optim/host_ops.h"

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace dmuon::detail {

namespace {

// CPU, strided, 2-D, all of `dtype`, small: above ATen's grain size its multi-threaded, vectorised
// kernels win and the dispatch is noise
bool host_matrix(const at::Tensor& t, at::ScalarType dtype) {
  return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && t.dim() == 2 &&
         t.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kDouble) &&
         t.numel() <= kHostMaxElems;
}

// `out` written element by element: no two of its elements share memory, and an input shares
// memory with it only as the very same view (element (i, j) read before it is written)
bool host_operands(const at::Tensor& out, std::initializer_list<const at::Tensor*> in) {
  if (!host_matrix(out, out.scalar_type()) || !out.is_non_overlapping_and_dense()) return false;
  for (const at::Tensor* t : in) {
    if (!host_matrix(*t, out.scalar_type()) || t->sizes() != out.sizes()) return false;
    if (t->is_alias_of(out) && (t->data_ptr() != out.data_ptr() || t->strides() != out.strides())) return false;
  }
  return true;
}

// what ATen's in-place ops do: autograd then sees that a saved tensor changed
void bump_version(const at::Tensor& t) { t.unsafeGetTensorImpl()->bump_version(); }

// element (i, j) of a matrix; Flat: every operand contiguous, the matrix one row of numel elements
// (a loop the compiler vectorises)
template <class T, bool Flat>
struct Acc {
  T* p;
  int64_t s0, s1;
  explicit Acc(const at::Tensor& t) : p(t.data_ptr<T>()), s0(t.stride(0)), s1(t.stride(1)) {}
  T& operator()(int64_t i, int64_t j) const {
    if constexpr (Flat)
      return p[j];
    else
      return p[i * s0 + j * s1];
  }
};

// f(i, j) over every element of `like`'s shape, row by row
template <bool Flat, class F>
void for_each_element(const at::Tensor& like, F&& f) {
  const int64_t rows = Flat ? 1 : like.size(0), cols = Flat ? like.numel() : like.size(1);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) f(i, j);
}

bool all_contiguous(std::initializer_list<const at::Tensor*> ts) {
  for (const at::Tensor* t : ts)
    if (!t->is_contiguous()) return false;
  return true;
}

template <class T, bool Flat>
void add_loop(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, double alpha) {
  const Acc<T, Flat> o(out), x(a), y(b);
  const T al = static_cast<T>(alpha);
  for_each_element<Flat>(out, [&](int64_t i, int64_t j) { o(i, j) = x(i, j) + al * y(i, j); });
}

template <class T, bool Flat>
void scale_add_loop(const at::Tensor& t, double decay, const at::Tensor& u, double alpha) {
  const Acc<T, Flat> o(t), x(u);
  const T d = static_cast<T>(decay), al = static_cast<T>(alpha);  // (decay 1: o * 1 is exact)
  for_each_element<Flat>(t, [&](int64_t i, int64_t j) { o(i, j) = o(i, j) * d + al * x(i, j); });
}

// kernel(T{}, std::bool_constant<Flat>{}) for the written tensor's dtype (float / double) and
// whether every operand is contiguous
template <class K>
void dispatch(const at::Tensor& out, std::initializer_list<const at::Tensor*> operands, K&& kernel) {
  auto typed = [&](auto zero) {
    if (all_contiguous(operands))
      kernel(zero, std::true_type{});
    else
      kernel(zero, std::false_type{});
  };
  if (out.scalar_type() == at::kFloat)
    typed(float{});
  else
    typed(double{});
}

template <class T>
bool sum_finite(const at::Tensor& t) {
  const Acc<T, false> x(t);
  T s = 0;
  for_each_element<false>(t, [&](int64_t i, int64_t j) { s += x(i, j); });
  return std::isfinite(s);
}

}  // namespace

bool host_add(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, double alpha) {
  if (!host_operands(out, {&a, &b})) return false;
  dispatch(out, {&out, &a, &b}, [&](auto zero, auto flat) {
    add_loop<decltype(zero), decltype(flat)::value>(out, a, b, alpha);
  });
  bump_version(out);
  return true;
}

bool host_scale_add(const at::Tensor& t, double decay, const at::Tensor& u, double alpha) {
  if (!host_operands(t, {&u})) return false;
  dispatch(t, {&t, &u}, [&](auto zero, auto flat) {
    scale_add_loop<decltype(zero), decltype(flat)::value>(t, decay, u, alpha);
  });
  bump_version(t);
  return true;
}

std::optional<bool> host_sum_finite(const at::Tensor& t) {
  if (!host_matrix(t, t.scalar_type())) return std::nullopt;
  return t.scalar_type() == at::kFloat ? sum_finite<float>(t) : sum_finite<double>(t);
}

}  // namespace dmuon::detail
