// env.h -- the one place dmuon reads its environment variables (their names and meanings: README, "Environment variables").
//
// Each getter reads the variable on every call (cheap; lets tests set and unset them) and returns
// "" / nullopt when unset. Values are validated by the code that uses them, which names the
// variable in its error message.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace dmuon::env {

std::string owner_strategy();               // DMUON_OWNER_STRATEGY: "lpt" | "round_robin" | "rank0"
std::string owner_cost_model();             // DMUON_OWNER_COST_MODEL: "optimizer" | "numel" | "profiled"
std::string ns_profile();                   // DMUON_NS_PROFILE: path of the profile "profiled" uses
std::optional<bool> hsdp_column_balance();  // DMUON_HSDP_COLUMN_BALANCE: 0/1, true/false
std::optional<bool> pack_small_params();    // DMUON_OWNER_PACK_SMALL_PARAMS: 0/1, true/false
std::string ns_kernel();                    // DMUON_NS_KERNEL: "auto" | "cublas" | "syrk"
std::optional<bool> ns_cuda_graphs();       // DMUON_NS_CUDA_GRAPHS: 0 turns Muon's NS CUDA graphs off
std::optional<bool> ns_cpu_fused();         // DMUON_NS_CPU_FUSED: 0 keeps small CPU NS on ATen calls
std::optional<bool> batched_ns();           // DMUON_BATCHED_NS: 0 runs Muon's NS one matrix at a time
std::string ns_batch_mb();                  // DMUON_NS_BATCH_MB: cap of one stacked NS call, MiB
std::string process_group_policy();         // DMUON_PROCESS_GROUP_POLICY: "isolated" | "shared"
bool isolated_pg_barrier();                 // DMUON_ISOLATED_PG_BARRIER=1: strict post-step fence
bool record_forward_profile();              // DMUON_RECORD_FORWARD_PROFILE=1
// DMUON_COLLECTIVE_TIMEOUT: seconds (> 0) for the Python front end's collectives, in place of the
// timeout of the process group the mesh is built from.
std::string collective_timeout();
std::string cpu_backend();                  // DMUON_CPU_BACKEND: "gloo" | "store" (CPU process groups)
// DMUON_FORCE_COLLECTIVES=1: groups of one issue real collectives and the dedicated route takes the
// reduce path at world size 1, so one GPU (NCCL, world size 1) exercises the multi-rank code.
bool force_collectives();
// DMUON_FAST_CLIP=0: the fused (foreach) clipping path off everywhere, and
// try_clip_optimizer_grad_norm_buckets_ returns nullopt (it must be the same on every rank).
std::optional<bool> fast_clip();
std::string fast_clip_chunk_size();         // DMUON_FAST_CLIP_CHUNK_SIZE: elements per fused clip call

// Parses a boolean flag value ("1", "0", "true", "false", "on", "off", "yes", "no", any case).
// Throws std::invalid_argument naming `var` and the value when it is none of those.
bool parse_bool(const std::string& var, const std::string& value);
// A count from an environment variable: decimal digits only (no sign, space or exponent), from 1 to `max`;
// nullopt otherwise (the caller says what the variable is for).
std::optional<int64_t> parse_count(const std::string& value, int64_t max);

}  // namespace dmuon::env
