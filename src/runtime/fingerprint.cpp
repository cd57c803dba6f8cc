// The cross-rank plan check (see fingerprint.h).
#include "runtime/fingerprint.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <climits>
#include <sstream>

namespace dmuon {

void check_plan_agreement(Mesh& mesh, const OwnerPlan& plan, const std::vector<ParamSpec>& specs,
                          const std::vector<Precision>& precisions, uint64_t base_digest, const PlanOptions& po,
                          const std::exception_ptr& failure) {
  const int rank = mesh.global_rank();
  // [fingerprint, count, setup failed] from every rank; a mismatch names the first differing parameter.
  auto opt = at::TensorOptions().dtype(at::kLong);
  uint64_t fp = plan.fingerprint ^ base_digest;
  for (const auto& pr : precisions) fp = fp * 1099511628211ull ^ precision_digest(pr);
  at::Tensor mine = at::tensor(
      {static_cast<int64_t>(fp), static_cast<int64_t>(specs.size()), failure ? int64_t{1} : int64_t{0}}, opt);
  const int n = mesh.world_size();
  at::Tensor all = at::empty({3 * n}, opt);
  mesh.world().allgather_flat(all, mine, "plan fingerprint check").wait();
  const at::Tensor host = all.cpu();
  const int64_t* a = host.data_ptr<int64_t>();
  std::string failed;
  for (int r = 0; r < n; ++r)
    if (a[3 * r + 2] != 0) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
  if (failure) std::rethrow_exception(failure);
  TORCH_CHECK(failed.empty(), "rank ", rank, ": dedicate_params: setup failed on rank(s) ", failed,
              " before the ranks compared their owner plans (this rank's setup succeeded; see their errors). Every "
              "rank must build the same model and pass the same options before dedicate_params.");
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
    // per-parameter digests: find the first parameter whose spec differs from rank 0's
    const int64_t np = static_cast<int64_t>(specs.size());
    at::Tensor d = at::empty({np}, opt);
    for (int64_t i = 0; i < np; ++i) {
      OwnerPlan one = plan_owners({specs[static_cast<size_t>(i)]}, 1, 1, po);
      d[i] = static_cast<int64_t>((one.fingerprint ^ precision_digest(precisions[static_cast<size_t>(i)])) * 31 +
                                  static_cast<uint64_t>(specs[static_cast<size_t>(i)].tp_split_dim + 1));
    }
    at::Tensor alld = at::empty({np * n}, opt);
    mesh.world().allgather_flat(alld, d, "plan fingerprint diagnosis").wait();
    const at::Tensor hd = alld.cpu();
    const int64_t* dd = hd.data_ptr<int64_t>();
    for (int64_t i = 0; i < np && detail.empty(); ++i)
      for (int r = 1; r < n; ++r)
        if (dd[r * np + i] != dd[i]) {
          std::ostringstream o;
          o << "parameter #" << i << " ('" << specs[static_cast<size_t>(i)].name << "' on this rank, shape "
            << at::IntArrayRef(specs[static_cast<size_t>(i)].shape) << ") differs between rank 0 and rank " << r
            << " (its shape, name, boundary, tensor-parallel split or mixed-precision policy)";
          detail = o.str();
          break;
        }
    if (detail.empty())
      detail = "the planner options, the environment (DMUON_OWNER_*) or the mixed-precision policy (dtypes of "
               "the non-dedicated parameters, the boundaries' cast_forward_inputs/output_dtype) differ between ranks";
  }
  TORCH_CHECK(false, "rank ", rank, ": dedicate_params: the owner plan differs between ranks: ", detail,
              ". Every rank must build the same model and pass the same options before dedicate_params.");
}

}  // namespace dmuon
