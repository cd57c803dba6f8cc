// ns_graphs.cpp -- CUDA-graph replay of Newton-Schulz (ns_graphs.h).
#include "dmuon/ns_graphs.h"

#if DMUON_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace dmuon {

struct NsGraphs::Entry {
#if DMUON_WITH_CUDA
  at::cuda::CUDAGraph graph;
#endif
  at::Tensor in, out;
};

NsGraphs::NsGraphs(NewtonSchulz ns, NsGraphOptions opts) : ns_(std::move(ns)), opts_(opts) {}
NsGraphs::~NsGraphs() = default;

bool NsGraphs::supported() { return DMUON_WITH_CUDA != 0; }

at::Tensor NsGraphs::run(const at::Tensor& G, int steps) {
#if DMUON_WITH_CUDA
  if (opts_.enabled && G.is_cuda() && !ns_.options().check_finite) {
    const Key key{G.sizes().vec(), static_cast<int>(G.scalar_type()), static_cast<int>(G.device().index()), steps};
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      const int64_t need = 4 * 2 * static_cast<int64_t>(G.numel() * G.element_size());
      if (static_cast<int>(graphs_.size()) < opts_.max_graphs && bytes_ + need <= opts_.max_bytes) {
        c10::cuda::CUDAGuard device_guard(G.device());
        auto e = std::make_unique<Entry>();
        e->in = at::empty_like(G, at::MemoryFormat::Contiguous);
        e->in.copy_(G);
        const auto current = at::cuda::getCurrentCUDAStream();
        auto side = c10::cuda::getStreamFromPool(false, G.device().index());
        at::cuda::CUDAEvent ready;
        ready.record(current);
        ready.block(side);
        {
          c10::cuda::CUDAStreamGuard sg(side);
          for (int w = 0; w < opts_.warmup; ++w) e->out = ns_.local(e->in, steps);
          side.synchronize();
          e->graph.capture_begin();
          e->out = ns_.local(e->in, steps);
          e->graph.capture_end();
        }
        at::cuda::CUDAEvent done;
        done.record(side);
        done.block(current);
        bytes_ += need;
        ++stats_.captures;
        it = graphs_.emplace(key, std::move(e)).first;
      }
    }
    if (it != graphs_.end()) {
      Entry& e = *it->second;
      e.in.copy_(G);
      e.graph.replay();
      ++stats_.replays;
      return e.out.clone();
    }
  }
#endif
  ++stats_.eager;
  return ns_.local(G, steps);
}

}  // namespace dmuon
