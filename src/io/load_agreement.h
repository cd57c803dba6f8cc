// Internal: the agreement before a state dict loads (set_model_state_dict, set_optimizer_state_dict).
//
// Every rank passes its own copy of the full state dict. Two things go wrong silently or late when
// the ranks are left to themselves: a dict one rank refuses (its error leaves the others alone in the
// load's collectives until the timeout), and dicts that differ between ranks (each rank would load
// its own copy of a replicated parameter and the replicas would drift apart, never to be noticed).
// agree_load is comm's agreement (comm/agreement.h) in a state dict's words: this rank's checks, then
// one small all-gather over the world; a refusal anywhere raises on every rank, naming the rank that
// refused; a digest that differs from rank 0's raises on every rank, naming the first entry that
// differs. Nothing is written before it returns.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "dmuon/mesh.h"

namespace dmuon::io {

// One entry of a state dict's summary: its key and a digest of everything loading it uses.
using LoadEntry = std::pair<std::string, uint64_t>;

// A tensor's digest: its dtype, shape and the CRC32C of its bytes (a CUDA tensor is copied to the
// host first, one tensor at a time); the same bytes give the same digest on every machine. A sparse,
// quantized or meta tensor: its dtype and shape only.
uint64_t tensor_digest(const at::Tensor& t);

// collective over mesh.world(), every rank, whatever `check` throws: `check` validates this rank's
// dict (throwing what the caller reports), `summary` lists its entries in key order (called only when
// `check` passed). Throws on every rank when any rank's check threw (this rank's own exception where it
// is this rank's) or when the summaries differ from global rank 0's. A world of one exchanges nothing.
void agree_load(Mesh& mesh, const std::string& fn, const std::function<void()>& check,
                const std::function<std::vector<LoadEntry>()>& summary);

}  // namespace dmuon::io
