// The cross-rank plan check (see fingerprint.h).
#include "runtime/fingerprint.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <climits>
#include <sstream>
#include <stdexcept>

#include "dmuon/digest.h"

namespace dmuon {

namespace {

// FNV-1a 64 of what must agree per parameter, independent of the planner's options
uint64_t spec_digest(const ParamSpec& s, const Precision& prec) {
  Fnv1a h;
  h.str(s.name).i64(static_cast<int64_t>(s.shape.size()));
  for (int64_t v : s.shape) h.i64(v);
  h.i64(s.elem_bytes).str(s.group_key).str(s.route).i64(s.tp_split_dim).u64(precision_digest(prec));
  return h.value();
}

}  // namespace

void check_plan_agreement(Mesh& mesh, const OwnerPlan& plan, const std::vector<ParamSpec>& specs,
                          const std::vector<Precision>& precisions, uint64_t base_digest, const PlanOptions& po,
                          const std::exception_ptr& failure) {
  const int rank = mesh.global_rank();
  // [fingerprint, count, setup failed] from every rank; a mismatch names the first differing parameter.
  // built on the host, exchanged on the mesh's device (NCCL takes CUDA tensors only)
  const auto host_opt = at::TensorOptions().dtype(at::kLong);
  Fnv1a mixed(plan.fingerprint ^ base_digest);
  for (const auto& pr : precisions) mixed.u64(precision_digest(pr));
  const uint64_t fp = mixed.value();
  // the failure's kind crosses too, so the other ranks raise the same kind: 1 a caller mistake (ValueError
  // in Python), 2 anything else
  int64_t failed_kind = 0;
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const c10::ValueError&) {
      failed_kind = 1;
    } catch (const std::invalid_argument&) {
      failed_kind = 1;
    } catch (...) {
      failed_kind = 2;
    }
  }
  const at::Tensor mine =
      at::tensor({static_cast<int64_t>(fp), static_cast<int64_t>(specs.size()), failed_kind}, host_opt)
          .to(mesh.device());
  const int n = mesh.world_size();
  at::Tensor all = at::empty({3 * n}, mesh.options(at::kLong));
  mesh.world().allgather_flat(all, mine, "plan fingerprint check").wait_host();
  const at::Tensor host = all.cpu();
  const int64_t* a = host.data_ptr<int64_t>();
  std::string failed;
  bool mistakes_only = true;  // every failed rank's error was a caller mistake
  for (int r = 0; r < n; ++r)
    if (a[3 * r + 2] != 0) {
      failed += (failed.empty() ? "" : ", ") + std::to_string(r);
      mistakes_only = mistakes_only && a[3 * r + 2] == 1;
    }
  if (failure) std::rethrow_exception(failure);
  if (!failed.empty()) {
    const std::string what = "rank " + std::to_string(rank) + ": dedicate_params: setup failed on rank(s) " + failed +
                             " before the ranks compared their owner plans (this rank's setup succeeded; see their "
                             "errors). Every rank must build the same model and pass the same options before "
                             "dedicate_params.";
    if (mistakes_only) TORCH_CHECK_VALUE(false, what);
    TORCH_CHECK(false, what);
  }
  bool same = true;
  for (int r = 0; r < n; ++r) same = same && a[3 * r] == a[0];
  if (same) return;
  int64_t max_count = 0, min_count = INT64_MAX;
  for (int r = 0; r < n; ++r) {
    max_count = std::max(max_count, a[3 * r + 1]);
    min_count = std::min(min_count, a[3 * r + 1]);
  }
  std::string detail;
  if (max_count != min_count) {
    std::ostringstream o;
    o << "ranks select different numbers of dedicated parameters (this rank " << specs.size() << ", others between "
      << min_count << " and " << max_count << ")";
    detail = o.str();
  } else {
    // per-parameter digests of the specs alone, then one of the resolved planner options (a plan of
    // no parameters): the first parameter whose spec differs from rank 0's, else the options
    const int64_t np = static_cast<int64_t>(specs.size());
    at::Tensor d = at::empty({np + 1}, host_opt);
    for (int64_t i = 0; i < np; ++i)
      d[i] = static_cast<int64_t>(spec_digest(specs[static_cast<size_t>(i)], precisions[static_cast<size_t>(i)]));
    d[np] = static_cast<int64_t>(plan_owners({}, 1, 1, po).fingerprint);
    at::Tensor alld = at::empty({(np + 1) * n}, mesh.options(at::kLong));
    mesh.world().allgather_flat(alld, d.to(mesh.device()), "plan fingerprint diagnosis").wait_host();
    const at::Tensor hd = alld.cpu();
    const int64_t* dd = hd.data_ptr<int64_t>();
    for (int64_t i = 0; i <= np && detail.empty(); ++i)
      for (int r = 1; r < n; ++r)
        if (dd[r * (np + 1) + i] != dd[i]) {
          std::ostringstream o;
          if (i < np)
            o << "parameter #" << i << " ('" << specs[static_cast<size_t>(i)].name << "' on this rank, shape "
              << at::IntArrayRef(specs[static_cast<size_t>(i)].shape) << ") differs between rank 0 and rank " << r
              << " (its shape, name, assignment group, tensor-parallel split or mixed-precision policy)";
          else
            o << "the planner options differ between rank 0 and rank " << r << " (PlanOptions or the DMUON_OWNER_* "
              << "environment: strategy, cost model, packing; with owner_cost_model \"profiled\", the NS profile: "
              << "PlanOptions::ns_profile / DMUON_NS_PROFILE must hold the same measurements on every rank)";
          detail = o.str();
          break;
        }
    if (detail.empty())
      detail = "the mixed-precision policy (dtypes of the non-dedicated parameters, the boundaries' "
               "cast_forward_inputs/output_dtype), the boundaries or the deferred parameters differ between ranks";
  }
  TORCH_CHECK(false, "rank ", rank, ": dedicate_params: the owner plan differs between ranks: ", detail,
              ". Every rank must build the same model and pass the same options before dedicate_params.");
}

}  // namespace dmuon
