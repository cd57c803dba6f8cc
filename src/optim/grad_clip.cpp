// Gradient-norm clipping over a dedicated model (see include/dmuon/grad_clip.h).
#include "dmuon/grad_clip.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>

#include "dmuon/host_sync.h"
#include "dmuon/muon.h"
#include "dmuon/communicator.h"
#include "dmuon/env.h"
#include "dmuon/mesh.h"
#include "optim/clip_norm.h"

namespace dmuon {

namespace {
std::mutex& strategies_mu() {
  static std::mutex mu;
  return mu;
}
std::map<std::string, MuonGradClipStrategy>& strategies() {
  static std::map<std::string, MuonGradClipStrategy> s;
  return s;
}
}  // namespace

void register_muon_grad_clip_strategy(const std::string& name, MuonGradClipStrategy strategy) {
  TORCH_CHECK_VALUE(name != "global_norm" && !name.empty(), "register_muon_grad_clip_strategy: '", name,
              "' is built in (or empty); pick another name.");
  TORCH_CHECK_VALUE(static_cast<bool>(strategy), "register_muon_grad_clip_strategy: the strategy '", name, "' is empty.");
  std::lock_guard<std::mutex> g(strategies_mu());
  strategies()[name] = std::move(strategy);
}

namespace {

// ---- local arithmetic: reference (float64) or fused (foreach kernels), per tensor ------------------
bool fast_clip_disabled() { return !env::fast_clip().value_or(true); }

bool fusable(const at::Tensor& g) {
  return g.layout() == at::kStrided && (g.scalar_type() == at::kFloat || g.scalar_type() == at::kDouble);
}

// The seed's default: fused for float32/float64 CUDA tensors. `force` (foreach=true): every fusable one.
bool use_fused(const at::Tensor& g, std::optional<bool> foreach) {
  if (foreach.has_value() && !*foreach) return false;
  if (fast_clip_disabled() || !fusable(g)) return false;
  return foreach.value_or(false) || g.is_cuda();
}

// Tensors of one (device, dtype) in calls of at most `chunk` elements each.
template <typename Fn>
void for_each_fused_call(const std::vector<at::Tensor>& ts, int64_t chunk, Fn&& fn) {
  std::map<std::pair<std::string, int>, std::vector<at::Tensor>> groups;
  for (const at::Tensor& t : ts) groups[{t.device().str(), static_cast<int>(t.scalar_type())}].push_back(t);
  for (auto& [key, list] : groups) {
    std::vector<at::Tensor> call;
    int64_t n = 0;
    for (const at::Tensor& t : list) {
      if (!call.empty() && n + t.numel() > chunk) {
        fn(call);
        call.clear();
        n = 0;
      }
      call.push_back(t);
      n += t.numel();
    }
    if (!call.empty()) fn(call);
  }
}

}  // namespace

namespace detail {
int64_t resolve_chunk(std::optional<int64_t> chunk) {
  if (chunk) {
    TORCH_CHECK_VALUE(*chunk > 0, "clip_grad_norm_buckets_: chunk_size must be > 0 elements, got ", *chunk);
    return *chunk;
  }
  if (const std::string v = env::fast_clip_chunk_size(); !v.empty()) {
    const std::optional<int64_t> n = env::parse_count(v, int64_t{1} << 40);
    TORCH_CHECK_VALUE(n, "DMUON_FAST_CLIP_CHUNK_SIZE='", v, "' is not an element count from 1 to 2^40 (decimal digits).");
    return *n;
  }
  return int64_t{1} << 24;
}

// sum |g|^p (p = inf: max |g|) over `grads`, as a float64 scalar on `dev`; `fused` says whether some
// tensor took the foreach path.
at::Tensor local_partial(const std::vector<at::Tensor>& grads, double p, std::optional<bool> foreach, int64_t chunk,
                         const at::Device& dev, bool& fused) {
  const bool inf = std::isinf(p);
  at::Tensor acc = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(dev));
  auto add = [&](const at::Tensor& v) { acc = inf ? at::maximum(acc, v.to(dev)) : acc + v.to(dev); };
  std::vector<at::Tensor> fast;
  for (const at::Tensor& g : grads) {
    if (!g.defined()) continue;
    if (use_fused(g, foreach)) {
      fast.push_back(g.detach());
      continue;
    }
    if (g.numel() == 0) continue;
    const at::Tensor a = g.detach().to(at::kDouble).abs();
    add(inf ? a.max() : (p == 2 ? a.mul(a).sum() : a.pow(p).sum()));
  }
  for_each_fused_call(fast, chunk, [&](const std::vector<at::Tensor>& call) {
    fused = true;
    const at::Tensor norms = at::stack(at::_foreach_norm(call, p)).to(at::kDouble);
    add(inf ? norms.max() : norms.pow(p).sum());
  });
  return acc;
}

void scale_all(const std::vector<at::Tensor>& grads, double coef, std::optional<bool> foreach, int64_t chunk) {
  std::vector<at::Tensor> fast;
  for (const at::Tensor& g : grads) {
    if (!g.defined()) continue;
    if (use_fused(g, foreach)) fast.push_back(g);
    else g.mul_(coef);
  }
  for_each_fused_call(fast, chunk, [&](const std::vector<at::Tensor>& call) { at::_foreach_mul_(call, coef); });
}

}  // namespace detail

namespace {
at::Device device_of(const std::vector<const std::vector<at::Tensor>*>& lists, const at::Device& fallback) {
  for (const auto* l : lists)
    for (const at::Tensor& g : *l)
      if (g.defined()) return g.device();
  return fallback;
}

double clip_coef_for(double max_norm, double total) { return std::min(1.0, max_norm / (total + 1e-6)); }

}  // namespace

// ---- Muon-scope and global-norm clipping -----------------------------------------------------------
namespace detail {
MuonGradClipStats clip_norm(std::vector<ClipGrad>& scope, std::optional<double> max_norm, const GradClipOptions& opts,
                            Mesh& mesh) {
  at::NoGradGuard ng;
  const double p = opts.norm_type;
  if (opts.strategy != "global_norm") {
    MuonGradClipStrategy custom;
    {
      std::lock_guard<std::mutex> g(strategies_mu());
      auto it = strategies().find(opts.strategy);
      if (it != strategies().end()) custom = it->second;
    }
    if (!custom) {
      std::string known = "global_norm";
      std::lock_guard<std::mutex> g(strategies_mu());
      for (const auto& [name, s] : strategies()) known += ", " + name;
      TORCH_CHECK_VALUE(false, "rank ", mesh.global_rank(), ": clip_grad_norm_: unknown strategy '", opts.strategy,
                  "'. Registered: ", known, " (register_muon_grad_clip_strategy adds one).");
    }
    MuonGradClipStats s = custom(scope, max_norm, opts, mesh);
    s.strategy = opts.strategy;
    return s;
  }
  // this rank's partial: sum |g|^p (or max |g|), the parameters it counts, as float64 on the device
  const bool inf = std::isinf(p);
  std::vector<at::Tensor> mine_counted, all_grads;
  int64_t count = 0;
  for (const ClipGrad& c : scope) {
    all_grads.push_back(c.grad);
    if (!c.counted) continue;
    mine_counted.push_back(c.grad);
    count += c.counts_param ? 1 : 0;
  }
  // on the mesh's device (NCCL groups take CUDA tensors), whatever this rank owns or holds
  const at::Device dev = mesh.device();
  const int64_t chunk = resolve_chunk(std::nullopt);
  bool fused = false;
  const at::Tensor part = local_partial(mine_counted, p, opts.foreach, chunk, dev, fused);
  // one all-gather of [partial, count] per rank, combined in rank order (the same bits everywhere)
  const int n = mesh.world_size();
  const at::Tensor mine = at::stack({part, at::scalar_tensor(static_cast<double>(count), part.options())});
  const at::Tensor all = at::empty({2 * n}, mine.options());
  mesh.world().allgather_flat(all, mine, "clip_grad_norm_: partial norms").wait_host();
  const at::Tensor host = detail::read_to_host(all);
  const double* a = host.data_ptr<double>();
  double acc = 0;
  int64_t nparams = 0;
  for (int r = 0; r < n; ++r) {
    acc = inf ? std::max(acc, a[2 * r]) : acc + a[2 * r];
    nparams += static_cast<int64_t>(a[2 * r + 1]);
  }
  MuonGradClipStats s;
  s.total_norm = inf ? acc : std::pow(acc, 1.0 / p);
  s.max_norm = max_norm;
  s.norm_type = p;
  s.param_count = nparams;
  s.found_inf = !std::isfinite(s.total_norm);
  TORCH_CHECK(!(s.found_inf && opts.error_if_nonfinite), "rank ", mesh.global_rank(), ": clip_grad_norm_: the total ",
              "norm of order ", p, " of the gradients is ", s.total_norm, ", so clipping cannot scale them. The loss "
              "diverged or a gradient overflowed: lower the learning rate, use loss scaling in half precision, or "
              "pass error_if_nonfinite=false to skip the step yourself when stats.found_inf.");
  if (max_norm && !s.found_inf) {
    s.clip_coef = clip_coef_for(*max_norm, s.total_norm);
    if (s.clip_coef < 1.0) {
      scale_all(all_grads, s.clip_coef, opts.foreach, chunk);  // every copy, counted or not
      s.clipped = true;
    }
  }
  return s;
}
}  // namespace detail

// ---- segmented (bucketed) clipping ------------------------------------------------------------------
const GradClipBucketStats* SegmentedGradClipResult::find(const std::string& name) const {
  for (const auto& b : bucket_stats)
    if (b.name == name) return &b;
  return nullptr;
}

SegmentedGradClipResult clip_grad_norm_buckets_(const std::vector<GradClipBucket>& buckets, std::optional<double> max_norm,
                                                Communicator* group, const BucketClipOptions& opts) {
  at::NoGradGuard ng;
  TORCH_CHECK_VALUE(!max_norm || *max_norm >= 0, "clip_grad_norm_buckets_: max_norm must be >= 0, got ", *max_norm);
  const int64_t chunk = detail::resolve_chunk(opts.chunk_size);
  const int64_t nb = static_cast<int64_t>(buckets.size());
  std::vector<const std::vector<at::Tensor>*> lists;
  for (const auto& b : buckets) lists.push_back(&b.grads), lists.push_back(&b.scale_only);
  const at::Device dev = group ? group->device() : device_of(lists, at::Device(at::kCPU));
  const auto f64 = at::TensorOptions().dtype(at::kDouble).device(dev);
  const int rank = group ? group->global_rank() : 0;
  // 1. the layout every rank must share: bucket count and reduce flags (a mismatch is an error, not a hang)
  double layout_code = 0;
  for (const auto& b : buckets) layout_code = layout_code * 2 + (b.reduce ? 1 : 0), layout_code = std::fmod(layout_code, 1e15);
  const int n = group ? group->size() : 1;
  if (n > 1) {
    const at::Tensor mine = at::tensor({static_cast<double>(nb), layout_code}, at::kDouble).to(dev);
    const at::Tensor all = at::empty({2 * n}, f64);
    group->allgather_flat(all, mine, "clip_grad_norm_buckets_: bucket layout").wait_host();
    const at::Tensor h = detail::read_to_host(all);
    const double* a = h.data_ptr<double>();
    for (int r = 0; r < n; ++r)
      TORCH_CHECK_VALUE(a[2 * r] == nb && a[2 * r + 1] == layout_code, "rank ", rank, ": clip_grad_norm_buckets_: this rank "
                  "passes ", nb, " bucket(s) (reduce-flag code ", layout_code, ") but rank ", group->global_ranks()[r],
                  " of group '", group->name(), "' passes ", a[2 * r], " (code ", a[2 * r + 1], "). Every rank must pass "
                  "the same buckets in the same order with the same reduce flags -- an empty bucket where it holds no "
                  "gradient -- so the collectives line up.");
  }
  // 2. per-bucket partials (sum of squares) and counts; one all-gather
  std::vector<at::Tensor> parts;
  std::vector<bool> fused(nb, false);
  std::vector<double> counts(nb, 0);
  for (int64_t i = 0; i < nb; ++i) {
    bool f = false;
    parts.push_back(detail::local_partial(buckets[i].grads, 2.0, opts.foreach, chunk, dev, f));
    fused[i] = f;
    for (const at::Tensor& g : buckets[i].grads) counts[i] += g.defined() ? 1 : 0;
  }
  std::vector<double> sq(nb, 0), cnt(counts);
  if (nb > 0) {
    const at::Tensor mine = at::cat({at::stack(parts), at::tensor(counts, at::kDouble).to(dev)});
    at::Tensor host;
    if (n > 1) {
      const at::Tensor all = at::empty({2 * nb * n}, f64);
      group->allgather_flat(all, mine, "clip_grad_norm_buckets_: partial norms").wait_host();
      host = detail::read_to_host(all);
    } else {
      host = detail::read_to_host(mine);
    }
    const double* a = host.data_ptr<double>();
    const int me = group ? group->rank() : 0;
    for (int64_t i = 0; i < nb; ++i) {
      if (!buckets[i].reduce) {
        sq[i] = a[2 * nb * me + i];
        cnt[i] = a[2 * nb * me + nb + i];
        continue;
      }
      sq[i] = 0, cnt[i] = 0;
      for (int r = 0; r < n; ++r) sq[i] += a[2 * nb * r + i], cnt[i] += a[2 * nb * r + nb + i];
    }
  }
  // 3. coefficients, scaling, stats
  SegmentedGradClipResult out;
  double total2 = 0;
  for (int64_t i = 0; i < nb; ++i) {
    GradClipBucketStats st;
    st.name = buckets[i].name;
    st.total_norm = std::sqrt(sq[i]);
    st.max_norm = max_norm;
    st.param_count = static_cast<int64_t>(cnt[i]);
    st.found_inf = !std::isfinite(st.total_norm);
    st.fastpath = fused[i];
    if (max_norm && !st.found_inf) {
      st.clip_coef = clip_coef_for(*max_norm, st.total_norm);
      if (st.clip_coef < 1.0) {
        bool f = false;
        for (const auto* l : {&buckets[i].grads, &buckets[i].scale_only}) {
          for (const at::Tensor& g : *l) f = f || (g.defined() && use_fused(g, opts.foreach));
          detail::scale_all(*l, st.clip_coef, opts.foreach, chunk);
        }
        st.clipped = true;
        st.fastpath = st.fastpath || f;
      }
    }
    total2 += sq[i];
    out.fastpath = out.fastpath || st.fastpath;
    out.bucket_stats.push_back(std::move(st));
  }
  out.total_norm = at::scalar_tensor(std::sqrt(total2), at::kDouble);
  if (!out.fastpath)
    out.fallback_reason = fast_clip_disabled() ? "DMUON_FAST_CLIP=0"
                          : opts.foreach.has_value() && !*opts.foreach ? "foreach=false"
                                                                       : "no float32/float64 CUDA gradient (reference math)";
  return out;
}

bool fast_clip_enabled() { return !fast_clip_disabled(); }

bool fast_clip_agreed(Communicator& g, const std::string& fn) {
  const bool on = !fast_clip_disabled();
  if (g.size() == 1) return on;
  const at::Tensor mine = at::full({1}, on ? 1 : 0, at::TensorOptions().dtype(at::kLong)).to(g.device());
  const at::Tensor all = at::empty({g.size()}, mine.options());
  g.allgather_flat(all, mine, fn + ": DMUON_FAST_CLIP").wait_host();
  const at::Tensor host = detail::read_to_host(all);
  std::string off;
  for (int r = 0; r < g.size(); ++r)
    if (host.data_ptr<int64_t>()[r] == 0) off += (off.empty() ? "" : ", ") + std::to_string(g.global_ranks()[r]);
  TORCH_CHECK_VALUE(off.empty() || host.sum().item<int64_t>() == 0, "rank ", g.global_rank(), ": ", fn,
                    ": DMUON_FAST_CLIP=0 on rank(s) ", off, " but not on the others; it decides whether the ranks "
                    "clip here or on their own path, so set it the same on every rank.");
  return on;
}

std::optional<SegmentedGradClipResult> try_clip_optimizer_grad_norm_buckets_(
    Muon& optimizer, const std::vector<at::Tensor>& regular_grads, const std::vector<at::Tensor>& adamw_grads,
    double max_norm, Communicator* group) {
  Communicator* g = group;
  if (!g) g = &optimizer.mesh().world();
  // the setting agreed over the group first: with a mixed one, some ranks would enter the clip's
  // collectives and the others not (a hang until the timeout)
  if (!fast_clip_agreed(*g, "try_clip_optimizer_grad_norm_buckets_"))
    return std::nullopt;  // the caller runs its own path (the same on every rank)
  std::vector<ClipGrad> muon = optimizer.clip_grads(ClipScope::Muon);  // collective: waits the reduces
  GradClipBucket m{"muon", {}, true, {}};
  for (ClipGrad& c : muon) (c.counted ? m.grads : m.scale_only).push_back(c.grad);
  SegmentedGradClipResult r = clip_grad_norm_buckets_(
      {GradClipBucket{"regular", regular_grads, false, {}}, m, GradClipBucket{"adamw", adamw_grads, true, {}}}, max_norm, g);
  if (const GradClipBucketStats* s = r.find("muon")) {
    MuonGradClipStats ms;
    ms.total_norm = s->total_norm;
    ms.max_norm = s->max_norm;
    ms.clip_coef = s->clip_coef;
    ms.clipped = s->clipped;
    ms.param_count = s->param_count;
    ms.found_inf = s->found_inf;
    ms.strategy = "segmented";
    detail::MuonInternals::set_last_clip(optimizer, ms);
  }
  return r;
}

MuonGradClipStats clip_grad_norm_(Muon& optimizer, std::optional<double> max_norm, const GradClipOptions& opts) {
  return optimizer.clip_grad_norm_(max_norm, opts);
}

}  // namespace dmuon
