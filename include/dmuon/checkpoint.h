// checkpoint.h -- full (unsharded) state dicts of a dedicated model and its Muon optimizer, and
// checkpoint files that resume on any world size and mesh.
//
// A state dict holds what a single-process model would hold: every parameter and buffer whole,
// keyed like named_parameters()/named_buffers(), in full precision (the master copy where mixed
// precision keeps one). Owners broadcast their matrices, sharded_adamw slices are all-gathered, so a
// checkpoint taken on 4 ranks loads on 3 (or on one process, or on an HSDP mesh): set_* places
// every value where the new plan wants it.
//
//   auto model_sd = dmuon::get_model_state_dict(*model);              // collective; rank 0 gets it
//   auto optim_sd = dmuon::get_optimizer_state_dict(*model, opt);      // collective
//   if (rank == 0) dmuon::save_checkpoint("ckpt.pt", model_sd, &optim_sd);   // atomic
//   ...
//   auto ck = dmuon::load_checkpoint("ckpt.pt");                       // every rank
//   dmuon::set_model_state_dict(*model, ck.model);                     // collective
//   dmuon::set_optimizer_state_dict(*model, opt, *ck.optim);           // collective
//
// All four get/set functions are collectives (every rank, same order) and drain in-flight
// broadcasts, reduces and publishes first; call them between optimizer steps.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dmuon/deferred_init.h"
#include "dmuon/muon.h"

namespace dmuon {

using TensorDict = std::map<std::string, at::Tensor>;

struct StateDictOptions {
  bool cpu_offload = true;  // returned tensors live on the CPU
  bool rank0_only = true;   // only global rank 0 returns a populated dict (every rank takes part)
};

// Hyperparameters of one lowered parameter group (a user group's Muon or AdamW half).
struct OptimizerGroupState {
  std::string name;
  bool is_muon = true;
  double lr = 0, momentum = 0, weight_decay = 0, beta1 = 0, beta2 = 0, eps = 0;
  bool nesterov = true;
  int64_t ns_steps = 5;
};

struct OptimizerStateDict {
  // Muon matrices: "<name>.momentum_buffer" (full matrix) and "<name>.step" (0-dim int64)
  TensorDict muon;
  // AdamW-trained parameters (replicated or sharded_adamw): "<name>.exp_avg", "<name>.exp_avg_sq"
  // (full tensors) and "<name>.step"
  TensorDict adamw;
  std::vector<OptimizerGroupState> param_groups;  // in the optimizer's lowered order
  int64_t steps_taken = 0;
  // The model's parameters the optimizer holds no state for (frozen, or no gradient in any step yet, as
  // torch's optimizer creates state at a parameter's first update). One the optimizer keeps is in its section
  // too, as its first step starts it -- zeros at step 0 -- so that every dict of a model holds the same keys (a
  // loader that fills only its template's keys, torch.distributed.checkpoint, finds them all).
  // set_optimizer_state_dict leaves them without state, whether they are trained now or not. After a step, a
  // parameter trained now that is neither here nor in a section is refused (the dict is incomplete), and so is
  // one with zeros at step 0 that is not named here (an entry never filled in).
  std::vector<std::string> without_state;
};

// collective: every rank, same order.
TensorDict get_model_state_dict(torch::nn::Module& model, const StateDictOptions& options = {});
// collective. Every rank passes the full dict (e.g. each read the same checkpoint file). A missing
// or unexpected key, or a shape that differs from the model's, is an error naming it. The ranks agree
// before anything is written: a dict refused on one rank raises on every rank (with that rank's
// reason), and copies that differ between ranks (dtype, shape or bytes: a CRC32C of each tensor) raise
// on every rank naming the first differing key; the model is left as it was.
void set_model_state_dict(torch::nn::Module& model, const TensorDict& state_dict);
// collective. Owner-local loading: each rank reads from `source` only what it keeps between steps
// (its matrices, its sharded_adamw slices, the replicated parameters, TP slices), e.g. from
// checkpoint_model_source or safetensors_source. The source must hold every parameter and buffer.
void set_model_state_dict(torch::nn::Module& model, ParamSource& source);

// The values of a state dict, before anything uses them: every group's hyperparameters (a Muon
// group's lr, momentum, weight_decay, ns_steps; an AdamW group's lr, beta1, beta2, eps,
// weight_decay) through check_hyperparameter, steps_taken and every "<name>.step" >= 0, and every
// state tensor finite (exp_avg_sq also >= 0). Throws c10::Error naming `where` and the group or
// tensor. load_checkpoint and set_optimizer_state_dict call it.
void check_optimizer_state_dict(const OptimizerStateDict& state_dict, const std::string& where);

// collective: every rank, same order.
OptimizerStateDict get_optimizer_state_dict(torch::nn::Module& model, const Muon& optimizer,
                                            const StateDictOptions& options = {});
// collective. Restores momentum buffers (on the new owners), AdamW moments (sliced for
// sharded_adamw), step counts and the groups' hyperparameters (learning rates included). After a
// step (steps_taken > 0) the state dict must hold the state of every parameter the optimizer
// trains; a missing one is an error naming it (an entry of zeros at step 0 is fresh state). Agreed across
// the ranks as set_model_state_dict's (hyperparameters, step counts and every state tensor).
void set_optimizer_state_dict(torch::nn::Module& model, Muon& optimizer, const OptimizerStateDict& state_dict);
// The same for a model given as data (model_view.h): `runtime` is runtime_face(dedicate_model_view(...)).
OptimizerStateDict get_optimizer_state_dict(const std::shared_ptr<RuntimeFace>& runtime, const Muon& optimizer,
                                            const StateDictOptions& options = {});
void set_optimizer_state_dict(const std::shared_ptr<RuntimeFace>& runtime, Muon& optimizer,
                              const OptimizerStateDict& state_dict);

// One file: written to a temporary name in the same directory, flushed to disk, then renamed over
// `path`, so a crash never leaves a partial checkpoint. The file is safetensors (safetensors.h),
// whatever `path` ends in, so Python and other tools read it: `safetensors.torch.load_file(path)`
// returns every tensor, keyed "model/<name>", "optim_muon/<name>.momentum_buffer" / "<name>.step",
// "optim_adamw/<name>.exp_avg" / ".exp_avg_sq" / ".step"; its metadata holds "format":
// "dmuon-checkpoint-safetensors-v1", "optimizer": JSON {"steps_taken", "param_groups": [{"name",
// "is_muon", "lr", "momentum", "weight_decay", "beta1", "beta2", "eps", "nesterov", "ns_steps"},
// ...]}, and "crc32c": JSON {"<tensor key>": CRC32C of its data bytes, ..., "optimizer": CRC32C of
// that string}. A rank reads only what it keeps (checkpoint_model_source reads by offset).
//
// Earlier dmuon versions wrote format version 2, a 32-byte header (magic "DMUONCKP", the version, the
// archive's length and CRC32C, the header's own CRC32C) and a torch::serialize archive with a
// CRC32C for every tensor and for the optimizer metadata. load_checkpoint still reads and verifies
// those files (they resume like any other); nothing writes them any more.
//
// `metadata` (optional) is stored with the checkpoint and covered by its checksums: the
// safetensors metadata "user" (a JSON object of strings; in a format-2 file, the archive's
// "metadata" entry). A caller keeps there what defines its run (the CLI: the architecture, the
// data's digest, the seed, the batch).
void save_checkpoint(const std::string& path, const TensorDict& model, const OptimizerStateDict* optimizer = nullptr,
                     const std::map<std::string, std::string>& metadata = {});

struct Checkpoint {
  TensorDict model;
  std::optional<OptimizerStateDict> optim;
  std::map<std::string, std::string> metadata;  // as passed to save_checkpoint
};
// Either format, safetensors or format 2 (the file's first bytes tell). A safetensors checkpoint
// written elsewhere (e.g. by Python with the layout above) loads too, but only with allow_unverified = true when it has no
// "crc32c" metadata (dmuon always writes it); with "crc32c", every tensor in the file must have its
// entry and every entry its tensor.
// Every rank may call it; it changes nothing and returns the file's contents only when they are
// intact: the whole archive and every tensor and the metadata are checked against their
// checksums. A damaged file is an error naming the file and the damaged tensor or section (the
// archive's structure when it is elsewhere); so are a truncated, empty or foreign file and a
// format-1 checkpoint (written before checksums, refused because it cannot be verified). The
// optimizer section's values are checked too (check_optimizer_state_dict).
Checkpoint load_checkpoint(const std::string& path);
// As above; with include_model=false the model section is left out (Checkpoint::model empty): a
// safetensors checkpoint then reads none of its model tensors (pair it with checkpoint_model_source).
Checkpoint load_checkpoint(const std::string& path, bool include_model, bool allow_unverified = false);
// The model section of a checkpoint as a ParamSource for set_model_state_dict: a safetensors
// checkpoint is read by offset, each rank only what it keeps, each tensor verified against its
// CRC32C as it is read; a format-2 archive (no random access) is read and verified whole.
std::shared_ptr<ParamSource> checkpoint_model_source(const std::string& path, bool allow_unverified = false);

// Whether `path` is a dmuon checkpoint of either format (by its first bytes and, for safetensors, its
// "format" metadata); false for anything else, a missing file included. Reads only the header.
bool is_dmuon_checkpoint(const std::string& path);

// CRC32C (Castagnoli) of n bytes, continuing from `crc` (0 to start): the checksum of checkpoint
// files, table-driven, 8 bytes per step.
uint32_t checkpoint_crc32c(const void* data, size_t n, uint32_t crc = 0);

}  // namespace dmuon
