// compat.h -- second names of dmuon functions, under which the Python DMuon API that dmuon mirrors
// knows them; each one only calls the dmuon function it names.
#pragma once

#include <torch/nn/module.h>

#include "dmuon/dedicate.h"
#include "dmuon/newton_schulz.h"
#include "dmuon/unshard_profile.h"

namespace dmuon {

// wait_all_post_step_broadcasts
inline void wait_all_replicate_broadcasts(torch::nn::Module& model) { wait_all_post_step_broadcasts(model); }
// prepare_muon_grads with default options
inline void wait_all_reduces(torch::nn::Module& model) { prepare_muon_grads(model); }
// gram_newton_schulz_factors
inline GramFactors gram_newton_schulz_q(const at::Tensor& G, const NsOptions& opts = {}) {
  return gram_newton_schulz_factors(G, opts);
}
// collect_forward_unshard_profile without synchronizing
inline ForwardUnshardProfile consume_forward_unshard_profile(torch::nn::Module& model, bool clear = true) {
  return collect_forward_unshard_profile(model, clear, false);
}

}  // namespace dmuon
