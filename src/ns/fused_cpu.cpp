// fused_cpu.cpp -- tensor front end of the fused CPU NS kernels (fused_cpu.h): padding, the batch
// loop over ATen's intra-op threads, factor segments, and the choice of the ISA copy.
#include "ns/fused_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "dmuon/env.h"
#include "ns/fused_cpu_table.h"

namespace dmuon::detail::fused_cpu {
namespace {

const Table* best_table() {
#if defined(__x86_64__) || defined(__i386__)
  const Table* a = avx2_table();
  if (a != nullptr && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return a;
#endif
  return generic_table();
}

std::atomic<const Table*>& current_table() {
  static std::atomic<const Table*> t{best_table()};
  return t;
}

const Table& table() { return *current_table().load(std::memory_order_relaxed); }

// Widths and heights are padded to two 32-byte vectors (the kernels' tile width).
template <typename T>
constexpr int64_t kPad = 64 / static_cast<int64_t>(sizeof(T));
int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// Scratch memory, 64-byte aligned, kept per thread between calls (a step calls NS many times with
// the same shapes; allocating ~40 KB per matrix showed up as malloc consolidation in profiles).
struct FreeAligned {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
T* scratch(int64_t count) {
  thread_local std::unique_ptr<T, FreeAligned> buf;
  thread_local int64_t capacity = 0;
  if (count > capacity) {
    const auto bytes = static_cast<size_t>(round_up(count * static_cast<int64_t>(sizeof(T)), 64));
    buf.reset();
    capacity = 0;  // (a failed allocation below leaves no stale capacity behind)
    void* p = std::aligned_alloc(64, bytes);
    TORCH_CHECK(p != nullptr, "newton_schulz (fused CPU kernel): could not allocate ", bytes,
                " bytes of scratch memory.");
    buf.reset(static_cast<T*>(p));
    capacity = count;
  }
  return buf.get();
}

void run_direct(const Table& t, float* x, float* w, int M, int N, const double* c, int s) {
  t.direct_f32(x, w, M, N, c, s);
}
void run_direct(const Table& t, double* x, double* w, int M, int N, const double* c, int s) {
  t.direct_f64(x, w, M, N, c, s);
}
int run_gram(const Table& t, float* x, float* w, int m, int M, int N, const double* c, const unsigned char* r, int s,
             float* seg) {
  return t.gram_f32(x, w, m, M, N, c, r, s, seg);
}
int run_gram(const Table& t, double* x, double* w, int m, int M, int N, const double* c, const unsigned char* r,
             int s, double* seg) {
  return t.gram_f64(x, w, m, M, N, c, r, s, seg);
}
void run_apply(const Table& t, const float* q, float* x, float* w, int M, int N) { t.apply_f32(q, x, w, M, N); }
void run_apply(const Table& t, const double* q, double* x, double* w, int M, int N) { t.apply_f64(q, x, w, M, N); }

// Copies an r x c block between a dense [r, c] matrix and a padded one (leading dimension ld).
template <typename T>
void pad_in(const T* from, T* to, int64_t r, int64_t c, int64_t ld, int64_t padded_rows) {
  std::memset(to, 0, sizeof(T) * static_cast<size_t>(padded_rows * ld));
  for (int64_t i = 0; i < r; ++i) std::memcpy(to + i * ld, from + i * c, sizeof(T) * static_cast<size_t>(c));
}
template <typename T>
void pad_out(const T* from, T* to, int64_t r, int64_t c, int64_t ld) {
  for (int64_t i = 0; i < r; ++i) std::memcpy(to + i * c, from + i * ld, sizeof(T) * static_cast<size_t>(c));
}

struct Dims {
  int64_t batch, m, n, M, N;
};
template <typename T>
Dims dims_of(const at::Tensor& X) {
  const int64_t m = X.size(-2), n = X.size(-1);
  return Dims{X.dim() == 3 ? X.size(0) : 1, m, n, round_up(m, kPad<T>), round_up(n, kPad<T>)};
}

// Direct (restart == nullptr) or Gram NS of every matrix of X.
template <typename T>
at::Tensor run(const at::Tensor& X, const Coefficients& coeffs, const std::vector<bool>* restart,
               std::vector<at::Tensor>* segments) {
  const at::Tensor Xc = X.contiguous();
  const Dims d = dims_of<T>(Xc);
  const int steps = static_cast<int>(coeffs.size());
  std::vector<double> c;
  for (const auto& [a, b, cc] : coeffs) c.insert(c.end(), {a, b, cc});
  std::vector<unsigned char> rs(static_cast<size_t>(steps), 0);
  int64_t nseg = 1;
  if (restart) {
    for (int s = 1; s < steps; ++s) {
      rs[static_cast<size_t>(s)] = (*restart)[static_cast<size_t>(s)] ? 1 : 0;
      nseg += rs[static_cast<size_t>(s)];
    }
  }
  at::Tensor out = at::empty_like(Xc);
  at::Tensor segs;
  if (segments) segs = at::empty({d.batch, nseg, d.m, d.m}, Xc.options());
  const T* src = Xc.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  T* seg_dst = segments ? segs.data_ptr<T>() : nullptr;
  const Table& tb = table();
  const int64_t MN = d.M * d.N, MM = d.M * d.M;
  at::parallel_for(0, d.batch, 1, [&](int64_t begin, int64_t end) {
    T* x = scratch<T>(3 * MN + 6 * MM + nseg * MM);
    T* work = x + MN;
    T* seg = work + 2 * MN + 6 * MM;
    for (int64_t b = begin; b < end; ++b) {
      pad_in(src + b * d.m * d.n, x, d.m, d.n, d.N, d.M);
      if (restart == nullptr) {
        run_direct(tb, x, work, static_cast<int>(d.M), static_cast<int>(d.N), c.data(), steps);
      } else {
        run_gram(tb, x, work, static_cast<int>(d.m), static_cast<int>(d.M), static_cast<int>(d.N), c.data(),
                 rs.data(), steps, seg_dst ? seg : nullptr);
      }
      pad_out(x, dst + b * d.m * d.n, d.m, d.n, d.N);
      if (seg_dst)
        for (int64_t s = 0; s < nseg; ++s) pad_out(seg + s * MM, seg_dst + (b * nseg + s) * d.m * d.m, d.m, d.m, d.M);
    }
  });
  if (segments) {
    segments->clear();
    for (int64_t s = 0; s < nseg; ++s) {
      at::Tensor q = segs.select(1, s);
      segments->push_back(Xc.dim() == 3 ? q.contiguous() : q.select(0, 0).contiguous());
    }
  }
  return out;
}

template <typename T>
at::Tensor apply_impl(const at::Tensor& X, const std::vector<at::Tensor>& segments) {
  const at::Tensor Xc = X.contiguous();
  const Dims d = dims_of<T>(Xc);
  std::vector<at::Tensor> qs;
  for (const at::Tensor& s : segments) {
    TORCH_CHECK(s.scalar_type() == Xc.scalar_type() && s.size(-1) == d.m && s.size(-2) == d.m &&
                    s.numel() == d.batch * d.m * d.m,
                "apply_gram_factors: a factor segment has shape ", s.sizes(), " and dtype ", s.scalar_type(),
                "; expected ", d.batch, " matrices of ", d.m, " x ", d.m, " in ", Xc.scalar_type(),
                " (the factors of a matrix of this shape).");
    qs.push_back(s.contiguous());
  }
  at::Tensor out = at::empty_like(Xc);
  const T* src = Xc.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const Table& tb = table();
  const int64_t MN = d.M * d.N, MM = d.M * d.M;
  at::parallel_for(0, d.batch, 1, [&](int64_t begin, int64_t end) {
    T* x = scratch<T>(2 * MN + MM);
    T* work = x + MN;
    T* q = work + MN;
    for (int64_t b = begin; b < end; ++b) {
      pad_in(src + b * d.m * d.n, x, d.m, d.n, d.N, d.M);
      for (const at::Tensor& s : qs) {
        pad_in(s.data_ptr<T>() + b * d.m * d.m, q, d.m, d.m, d.M, d.M);
        run_apply(tb, q, x, work, static_cast<int>(d.M), static_cast<int>(d.N));
      }
      pad_out(x, dst + b * d.m * d.n, d.m, d.n, d.N);
    }
  });
  return out;
}

}  // namespace

bool supports(const at::Tensor& X) {
  if (!X.defined() || !X.device().is_cpu() || (X.dim() != 2 && X.dim() != 3)) return false;
  const int64_t m = X.size(-2), n = X.size(-1);
  if (m < 1 || m > n || m > kMaxSide) return false;
  if (X.scalar_type() == at::kFloat) return round_up(m, kPad<float>) * round_up(n, kPad<float>) <= kMaxElems;
  if (X.scalar_type() == at::kDouble) return round_up(m, kPad<double>) * round_up(n, kPad<double>) <= kMaxElems;
  return false;
}

bool applies(const NsOptions& opts, const std::string& kernel, const at::Tensor& X) {
  return kernel == "cublas" && opts.cpu_fused && supports(X) && env::ns_cpu_fused().value_or(true);
}

const char* isa() { return table().isa; }

bool select_isa(const std::string& isa) {
  const Table* t = isa.empty() ? best_table() : isa == "generic" ? generic_table() : nullptr;
  if (isa == "avx2" && best_table() == avx2_table()) t = avx2_table();
  if (t == nullptr) return false;
  current_table().store(t);
  return true;
}

at::Tensor direct(const at::Tensor& X, const Coefficients& coeffs) {
  TORCH_INTERNAL_ASSERT(supports(X));
  return X.scalar_type() == at::kFloat ? run<float>(X, coeffs, nullptr, nullptr)
                                       : run<double>(X, coeffs, nullptr, nullptr);
}

at::Tensor gram(const at::Tensor& X, const Coefficients& coeffs, const std::vector<bool>& restart,
                std::vector<at::Tensor>* segments) {
  TORCH_INTERNAL_ASSERT(supports(X) && restart.size() == coeffs.size());
  return X.scalar_type() == at::kFloat ? run<float>(X, coeffs, &restart, segments)
                                       : run<double>(X, coeffs, &restart, segments);
}

at::Tensor apply(const at::Tensor& X, const std::vector<at::Tensor>& segments) {
  TORCH_INTERNAL_ASSERT(supports(X));
  return X.scalar_type() == at::kFloat ? apply_impl<float>(X, segments) : apply_impl<double>(X, segments);
}

}  // namespace dmuon::detail::fused_cpu
