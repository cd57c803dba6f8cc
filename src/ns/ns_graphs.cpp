// ns_graphs.cpp -- CUDA-graph replay of Newton-Schulz (ns_graphs.h).
#include "dmuon/ns_graphs.h"

#include <c10/util/Logging.h>

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
  at::cuda::CUDAEvent used;  // after the last replay's output was copied out (on the caller's stream)
#endif
  at::Tensor in, out;
};

#if DMUON_WITH_CUDA
// Captures run on a stream of their own (not one of the pool streams communication may use), in
// thread-local capture mode, so work that other threads issue meanwhile (process-group watchdogs,
// Gloo's copies) neither breaks the capture nor is waited for.
struct NsGraphs::Streams {
  std::map<int, cudaStream_t> by_device;
  ~Streams() {
    for (auto& [d, s] : by_device) (void)cudaStreamDestroy(s);
  }
  c10::cuda::CUDAStream get(c10::DeviceIndex device) {
    auto it = by_device.find(device);
    if (it == by_device.end()) {
      cudaStream_t s = nullptr;
      C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      it = by_device.emplace(device, s).first;
    }
    return c10::cuda::getStreamFromExternal(it->second, device);
  }
};
#else
struct NsGraphs::Streams {};
#endif

NsGraphs::NsGraphs(NewtonSchulz ns, NsGraphOptions opts)
    : ns_(std::move(ns)), opts_(opts), streams_(std::make_unique<Streams>()) {}
NsGraphs::~NsGraphs() {
  graphs_.clear();  // the graphs before the streams they were captured on
  streams_.reset();
}

bool NsGraphs::supported() { return DMUON_WITH_CUDA != 0; }

at::Tensor NsGraphs::run(const at::Tensor& G, int steps) {
#if DMUON_WITH_CUDA
  if (opts_.enabled && G.is_cuda() && !ns_.options().check_finite) {
    const Key key{G.sizes().vec(), static_cast<int>(G.scalar_type()), static_cast<int>(G.device().index()), steps};
    c10::cuda::CUDAGuard device_guard(G.device());
    const auto current = at::cuda::getCurrentCUDAStream();
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      const int64_t need = 4 * 2 * static_cast<int64_t>(G.numel() * G.element_size());
      if (static_cast<int>(graphs_.size()) < opts_.max_graphs && bytes_ + need <= opts_.max_bytes) {
        auto e = std::make_unique<Entry>();
        e->in = at::empty_like(G, at::MemoryFormat::Contiguous);
        e->in.copy_(G);
        const c10::cuda::CUDAStream side = streams_->get(G.device().index());
        at::cuda::CUDAEvent ready;
        ready.record(current);
        ready.block(side);
        bool captured = false;
        {
          c10::cuda::CUDAStreamGuard sg(side);
          try {
            for (int w = 0; w < opts_.warmup; ++w) e->out = ns_.local(e->in, steps);  // settles kernels, workspaces
            side.synchronize();
            e->graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
            try {
              e->out = ns_.local(e->in, steps);
              e->graph.capture_end();
              captured = true;
            } catch (...) {
              try {
                e->graph.capture_end();  // ends the (invalidated) capture on our stream
              } catch (...) {
              }
              throw;
            }
          } catch (const std::exception& ex) {
            LOG(WARNING) << "dmuon: capturing Newton-Schulz of shape " << G.sizes()
                         << " into a CUDA graph failed; NS runs eagerly from now on (" << ex.what() << ")";
            opts_.enabled = false;
          }
        }
        at::cuda::CUDAEvent done;
        done.record(side);
        done.block(current);
        if (captured) {
          bytes_ += need;
          ++stats_.captures;
          it = graphs_.emplace(key, std::move(e)).first;
        }
      }
    }
    if (it != graphs_.end()) {
      Entry& e = *it->second;
      e.used.block(current);  // an earlier call on another stream has copied its output out
      e.in.copy_(G);
      e.graph.replay();
      ++stats_.replays;
      at::Tensor out = e.out.clone();
      e.used.record(current);
      return out;
    }
  }
#endif
  ++stats_.eager;
  return ns_.local(G, steps);
}

}  // namespace dmuon
