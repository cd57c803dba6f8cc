// dmuon._C: gradient clipping for Python (dmuon/grad_clip.h) -- Muon's live gradients for strategies
// written in Python, and segmented (bucket) clipping over a torch.distributed group. The Python package
// (dmuon/_clip.py) wraps these in the API reference's functions and dataclasses (the optimizer's
// three-bucket clip is written there over these two, so DTensor shards are counted once per mesh).
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "dmuon/grad_clip.h"
#include "dmuon/muon.h"

namespace dmuon::python {

namespace {

using namespace pybind11::literals;

// (name, grads (None entries skipped), reduce, scale_only) as dmuon/_clip.py passes them
using BucketTuple = std::tuple<std::string, std::vector<std::optional<at::Tensor>>, bool, std::vector<at::Tensor>>;

std::vector<at::Tensor> defined(const std::vector<std::optional<at::Tensor>>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts)
    if (t && t->defined()) out.push_back(*t);
  return out;
}

py::dict result_dict(const SegmentedGradClipResult& r) {
  py::list stats;
  for (const GradClipBucketStats& s : r.bucket_stats)
    stats.append(py::dict("name"_a = s.name, "total_norm"_a = s.total_norm, "max_norm"_a = s.max_norm,
                          "clip_coef"_a = s.clip_coef, "clipped"_a = s.clipped, "param_count"_a = s.param_count,
                          "found_inf"_a = s.found_inf, "fastpath"_a = s.fastpath));
  return py::dict("total_norm"_a = r.total_norm, "bucket_stats"_a = stats, "fastpath"_a = r.fastpath,
                  "fallback_reason"_a = r.fallback_reason);
}

}  // namespace

void bind_clip(py::module_& m) {
  m.def(
      "_muon_clip_grads",
      [](Muon& opt, bool all_params) {
        std::vector<ClipGrad> grads;
        {
          py::gil_scoped_release nogil;  // collective: waits the gradient reduces
          grads = opt.clip_grads(all_params ? ClipScope::AllParams : ClipScope::Muon);
        }
        py::list out;
        for (const ClipGrad& g : grads) out.append(py::make_tuple(g.name, g.grad, g.counted, g.counts_param));
        return out;
      },
      "Muon's live gradients in scope (collective: waits the reduces): (name, grad, counted, counts_param) each.",
      "optimizer"_a, "all_params"_a);

  m.def(
      "_clip_grad_norm_buckets",
      [](const std::vector<BucketTuple>& buckets, std::optional<double> max_norm,
         const c10::intrusive_ptr<c10d::ProcessGroup>& group, std::vector<int> global_ranks, const std::string& device,
         std::optional<int64_t> chunk_size, std::optional<bool> foreach) {
        std::vector<GradClipBucket> bs;
        for (const auto& [name, grads, reduce, scale_only] : buckets) bs.push_back({name, defined(grads), reduce, scale_only});
        const auto comm = communicator_of(group, std::move(global_ranks), at::Device(device), "clip_grad_norm_buckets_");
        BucketClipOptions o;
        o.chunk_size = chunk_size;
        o.foreach = foreach;
        SegmentedGradClipResult r;
        {
          py::gil_scoped_release nogil;
          r = clip_grad_norm_buckets_(bs, max_norm, comm.get(), o);
        }
        return result_dict(r);
      },
      "buckets"_a, "max_norm"_a, "group"_a, "global_ranks"_a, "device"_a, "chunk_size"_a, "foreach"_a);

  m.def(
      "_agree_call",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& group, std::vector<int> global_ranks, const std::string& device,
         const std::string& fn, const std::string& given, const std::string& outcome,
         const std::optional<std::pair<bool, std::string>>& refusal) {
        if (!group) {  // one process, no torch.distributed: only this rank's own refusal
          if (refusal) {
            if (refusal->first) throw std::invalid_argument(refusal->second);
            throw std::runtime_error(refusal->second);
          }
          return;
        }
        const auto comm = communicator_of(group, std::move(global_ranks), at::Device(device), fn);
        py::gil_scoped_release nogil;
        agree_call(*comm, fn, given, outcome, refusal);
      },
      "The agreement a collective call checked in Python opens with (dmuon::agree_call): every rank learns of a "
      "refusal and of ranks in another dmuon call.",
      "group"_a, "global_ranks"_a, "device"_a, "fn"_a, "given"_a, "outcome"_a, "refusal"_a);
  m.def("_fast_clip_enabled", &fast_clip_enabled, "DMUON_FAST_CLIP is unset or not 0.");
  m.def(
      "_fast_clip_agreed",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& group, std::vector<int> global_ranks, const std::string& device,
         const std::string& fn) {
        if (!group) return fast_clip_enabled();  // one process, no torch.distributed
        const auto comm = communicator_of(group, std::move(global_ranks), at::Device(device), fn);
        py::gil_scoped_release nogil;
        return fast_clip_agreed(*comm, fn);
      },
      "DMUON_FAST_CLIP agreed over the group (collective; a mixed setting is a ValueError on every rank).", "group"_a,
      "global_ranks"_a, "device"_a, "fn"_a);
}

}  // namespace dmuon::python
