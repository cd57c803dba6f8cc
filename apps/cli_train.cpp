// `dmuon train`: a small GPT on real text, N ranks, dedicated-ownership Muon (or an AdamW baseline).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <optional>
#include <sstream>
#include <thread>

#include "cli_commands.h"
#include "cli_files.h"
#include "cli_launch.h"
#include "cli_text.h"
#include "cli_train.h"
#include "dmuon/bootstrap.h"
#include "dmuon/checkpoint.h"
#include "dmuon/dedicate.h"
#include "dmuon/diagnostics.h"
#include "dmuon/env.h"
#include "dmuon/files.h"
#include "dmuon/grad_scaler.h"
#include "dmuon/memory.h"
#include "dmuon/muon.h"
#include "model/dedicated_gpt.h"
#include "model/gpt.h"
#include "model/hf_decoder.h"
#include "dmuon/safetensors.h"

namespace dmuon::cli {

namespace train {

constexpr const char* kMetricsHeader = "step,loss,lr,adamw_lr,step_ms,tokens_per_s,bytes,grad_norm,val_loss";

void add_options(CLI::App& app, TrainArgs& a) {
  app.add_option("--ranks", a.ranks, "number of local ranks to start (Gloo on CPU)")->capture_default_str();
  app.add_option("--steps", a.steps, "optimizer steps")->capture_default_str();
  app.add_option("--mode", a.mode, "DMuon mode: z3 (reshard after forward) or z2")
      ->check(CLI::IsMember({"z2", "z3"}))
      ->capture_default_str();
  app.add_option("--optimizer", a.optimizer, "dmuon (Muon on the layer matrices + AdamW) or adamw (baseline)")
      ->check(CLI::IsMember({"dmuon", "adamw"}))
      ->capture_default_str();
  app.add_option("--out", a.out, "output directory (metrics.csv, summary.json, loss.svg)")->capture_default_str();
  app.add_option("--data", a.data, "training text file (default: Debian's fortunes text)");
  app.add_option("--batch", a.batch, "global batch in sequences, split evenly across ranks")->capture_default_str();
  app.add_option("--seq-len", a.seq_len, "sequence length in bytes")->capture_default_str();
  app.add_option("--d-model", a.d_model, "model width")->capture_default_str();
  app.add_option("--layers", a.layers, "number of transformer blocks (layers.N)")->capture_default_str();
  app.add_option("--heads", a.heads, "attention heads")->capture_default_str();
  app.add_option("--lr", a.lr, "Muon learning rate")->capture_default_str();
  app.add_option("--adamw-lr", a.adamw_lr, "AdamW learning rate")->capture_default_str();
  app.add_option("--weight-decay", a.weight_decay, "Muon weight decay")->capture_default_str();
  app.add_option("--grad-accum", a.grad_accum, "micro-batches per optimizer step on every rank")->capture_default_str();
  app.add_option("--seed", a.seed, "seed of the model init and the data order")
      ->check(CLI::Validator(
          [](std::string& v) {
            uint64_t n = 0;
            const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
            return ec == std::errc() && end == v.data() + v.size()
                       ? std::string()
                       : "must be an integer in [0, 2^64), got " + v;
          },
          "NONNEGATIVE"))
      ->capture_default_str();
  app.add_option("--port", a.port, "rendezvous port on 127.0.0.1 (default, or 0: a free one)");
  app.add_option("--log-every", a.log_every, "progress/metrics interval in steps")->capture_default_str();
  app.add_option("--ns-backend", a.ns_backend, "Newton-Schulz form: gram or direct")
      ->check(CLI::IsMember({"gram", "direct"}))
      ->capture_default_str();
  app.add_option("--device", a.device, "cpu (Gloo) or cuda (NCCL, one GPU per rank: cuda:LOCAL_RANK)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--replicate", a.replicate, "HSDP: replicate groups R (ranks = R x shard size x tp)")
      ->capture_default_str();
  app.add_option("--loss-scale", a.loss_scale,
                 "dynamic loss scaling (dmuon::GradScaler: the loss times a scale, the gradients unscaled before "
                 "clipping, a step with an inf or NaN gradient on any rank skipped on every rank and the scale "
                 "halved, doubled after --loss-scale-growth-interval clean steps); auto: dynamic with --param-dtype fp16")
      ->check(CLI::IsMember({"auto", "dynamic", "off"}))
      ->capture_default_str();
  app.add_option("--loss-scale-init", a.loss_scale_init,
                 "loss scaling: the first scale (a resumed run takes the checkpoint's)")
      ->capture_default_str();
  app.add_option("--loss-scale-growth-interval", a.loss_scale_growth_interval,
                 "loss scaling: clean steps in a row before the scale doubles")
      ->capture_default_str();
  app.add_option("--clip-grad", a.clip_grad,
                 "clip the global gradient norm over all parameters to this before each step (0 = off; the "
                 "pre-clip norm is in metrics.csv either way)")
      ->capture_default_str();
  app.add_option("--tp", a.tp,
                 "tensor parallelism: T ranks per TP group (ranks = R x G x T); q/k/v (by heads) and gate/up "
                 "column-parallel, o and down row-parallel; the batch is split over the R x G data-parallel ranks")
      ->capture_default_str();
  app.add_flag("--shard-base", a.shard_base,
               "route the embedding, norms and head to sharded_adamw (1/N per rank) instead of replicating them");
  app.add_flag("--one-pass", a.one_pass,
               "step() waits every gradient reduce before any Newton-Schulz and publishes once "
               "(group_prepare_ahead off; default: group by group where it pays)");
  app.add_flag("--per-param-optim", a.per_param_optim,
               "AdamW and the Muon momentum by per-parameter ops (fused/foreach off; default: LibTorch's fused "
               "AdamW wherever it has one, _foreach_ momentum on CUDA)");
  app.add_option("--param-dtype", a.param_dtype,
                 "forward/backward and communication dtype of every parameter; bf16/fp16 keep fp32 master weights "
                 "and fp32 optimizer state; fp64 trains in float64 throughout (runs that verify equivalence)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16", "fp64"}))
      ->capture_default_str();
  app.add_option("--checkpoint", a.checkpoint,
                 "write a checkpoint (model + optimizer, full tensors) to this file after the last step");
  app.add_option("--checkpoint-every", a.checkpoint_every, "also write it every N steps (0: only at the end)")
      ->capture_default_str();
  app.add_option("--resume", a.resume,
                 "continue from a checkpoint written by --checkpoint (on any number of ranks / --replicate); "
                 "--steps is the total, counting the steps already taken; the learning rates and weight decay are "
                 "the checkpoint's unless --lr/--adamw-lr/--weight-decay are given (an override, logged); the model, "
                 "data, split, seed and batch must be the checkpoint's run's; metrics.csv in the same --out keeps "
                 "its earlier rows");
  app.add_flag("--allow-data-change", a.allow_data_change,
               "--resume with other data or sampling than the run that wrote the checkpoint: --data, the held-out "
               "split (--eval-every 0 / --val-fraction), --seed, --batch, --seq-len");
  app.add_flag("--allow-unverified-checkpoint", a.allow_unverified,
               "--resume a .safetensors checkpoint that has no \"crc32c\" metadata (written by another tool; "
               "dmuon's own always have it): its tensors cannot be verified");
  app.add_option("--hf-config", a.hf_config,
                 "build the architecture of this Hugging Face config.json (llama, mistral, qwen2, qwen3) with its "
                 "parameter names instead of the built-in GPT (--d-model/--layers/--heads are then ignored); tokens "
                 "are bytes, so vocab_size must be >= 256");
  app.add_option("--init-from", a.init_from,
                 "initial weights: a .safetensors file or a sharded model.safetensors.index.json (Hugging Face "
                 "names for --hf-config models; a file from --export-safetensors for either model)");
  app.add_option("--export-safetensors", a.export_safetensors,
                 "after the last step, write the full model (single-process shapes and names, float32 masters; "
                 "float64 with --param-dtype fp64) "
                 "to this .safetensors file");
  app.add_option("--eval-every", a.eval_every,
                 "validation loss on the held-out text every N steps and after the last (0: never)")
      ->capture_default_str();
  app.add_option("--val-fraction", a.val_fraction, "fraction of the text held out for validation (its tail)")
      ->capture_default_str();
  app.add_option("--eval-batches", a.eval_batches, "global batches of held-out text per evaluation")
      ->capture_default_str();
  app.add_option("--compare", a.compare,
                 "adamw: train twice on the same model and data, DMuon into OUT/dmuon and the AdamW baseline into "
                 "OUT/adamw, and draw both loss curves (train and validation) in OUT/compare.svg with the "
                 "steps-to-target-loss ratio in OUT/compare.json")
      ->check(CLI::IsMember({"adamw"}));
  app.add_option("--timeout", a.timeout_s, "collective timeout in seconds (a lost peer is an error after this)")
      ->capture_default_str();
}

[[noreturn]] void bad(const std::string& m) { throw std::invalid_argument(m); }

// An input every rank reads by itself: a regular file (a directory, a pipe or a device is named as such).
void check_input_file(const std::string& flag, const std::string& path) {
  if (const std::string why = input_file_problem(path); !why.empty()) bad(flag + " " + path + ": " + why);
}

// The path as the file system resolves it (symlinks and "..", for files that do not exist yet too).
std::filesystem::path resolved(const std::string& p) {
  std::error_code ec;
  std::filesystem::path r = std::filesystem::weakly_canonical(p, ec);
  return ec ? std::filesystem::absolute(p).lexically_normal() : r;
}

// --out: a directory (made if missing, see make_out_dir) that this process may write.
void check_out_dir(const TrainArgs& a) {
  namespace fs = std::filesystem;
  if (a.out.empty()) bad("--out must name a directory");
  if (fs::exists(a.out) && !fs::is_directory(a.out))
    bad("--out " + a.out + " exists and is not a directory; --out names the directory for metrics.csv, "
        "summary.json and loss.svg");
  if (fs::is_directory(a.out) && ::access(a.out.c_str(), W_OK) != 0)
    bad("--out " + a.out + ": the directory is not writable");
}

// --out made (with its parents) where missing: by the launcher before its checks (--checkpoint /
// --export-safetensors may lie in it) and by the lead rank; a failure names the flag.
void make_out_dir(const TrainArgs& a) {
  std::error_code ec;
  std::filesystem::create_directories(a.out, ec);
  if (ec) bad("--out " + a.out + ": cannot create the directory (" + ec.message() + "); --out names a writable directory");
}

// Every output path before step 1: a file (not a directory) in a writable directory, never an input
// (the data, the config, the initial weights or the checkpoint resumed from) nor another output.
void check_paths(const TrainArgs& a) {
  namespace fs = std::filesystem;
  check_out_dir(a);
  const std::vector<std::pair<std::string, std::string>> inputs{
      {"--data", a.data}, {"--hf-config", a.hf_config}, {"--init-from", a.init_from}, {"--resume", a.resume}};
  std::vector<std::pair<std::string, std::string>> outputs{{"--checkpoint", a.checkpoint},
                                                           {"--export-safetensors", a.export_safetensors}};
  for (const auto& [flag, path] : outputs) {
    if (path.empty()) continue;
    if (resolved(path) == resolved(a.out))
      bad(flag + " " + path + " is the --out directory; name a file, e.g. " + (fs::path(a.out) / "ckpt.pt").string());
    if (const std::string why = output_file_problem(path); !why.empty()) bad(flag + " " + path + ": " + why);
  }
  if (!a.resume.empty()) {  // the resumed rows are appended to metrics.csv: it must be one of ours
    std::ifstream in(fs::path(a.out) / "metrics.csv");
    std::string header;
    if (in && std::getline(in, header) && header != kMetricsHeader)
      bad("--resume into --out " + a.out + ": its metrics.csv is not a dmuon train metrics file of this version "
          "(the header differs), so the resumed rows cannot be appended to it; move it away or pick another --out");
  }
  for (const char* f : {"metrics.csv", "summary.json", "loss.svg"})
    outputs.emplace_back("--out (its " + std::string(f) + ")", (fs::path(a.out) / f).string());
  for (size_t i = 0; i < outputs.size(); ++i) {
    const auto& [oflag, out] = outputs[i];
    if (out.empty()) continue;
    for (size_t j = i + 1; j < outputs.size(); ++j)
      if (!outputs[j].second.empty() && resolved(out) == resolved(outputs[j].second))
        bad(oflag + " and " + outputs[j].first + " are the same file " + out + "; give them different paths");
    for (const auto& [iflag, in] : inputs) {
      // --checkpoint equal to --resume too: a failed or interrupted run must leave the checkpoint it
      // started from as it was
      if (in.empty()) continue;
      if (resolved(out) == resolved(in))
        bad(oflag + " " + out + " is also " + iflag + ": the run would overwrite its own input; write to another path");
    }
  }
}

std::string gib(double bytes) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(bytes < 1e8 ? 3 : 1) << bytes / (1024.0 * 1024 * 1024) << " GiB";
  return o.str();
}

// A lower bound of the memory the run takes on this machine (all its local ranks together), from
// the sizes alone, before anything is allocated: this host's share (local ranks / world) of the
// parameters with their gradients and optimizer state (16 bytes each in fp32, 32 in fp64) and of one
// micro-batch's activations, and every local rank's copy of the global batch. More than the machine
// has is refused with the estimate instead of a bad_alloc.
void check_memory(const TrainArgs& a, int world) {
  if (a.device != "cpu") return;  // on a GPU the model lives in device memory; its allocator says so
  double params = 0, d = 0, layers = 0, vocab = 256;
  if (a.hf_config.empty()) {
    models::GPTConfig g;
    g.d_model = a.d_model;
    d = static_cast<double>(a.d_model);
    layers = static_cast<double>(a.layers);
    const double ff = static_cast<double>(g.ffn_dim());
    params = 2 * vocab * d + layers * (4 * d * d + 3 * d * ff + 2 * d) + d;
  } else {
    const models::HFDecoderConfig c = models::HFDecoderConfig::load(a.hf_config);
    d = static_cast<double>(c.hidden_size);
    layers = static_cast<double>(c.num_hidden_layers);
    vocab = static_cast<double>(c.vocab_size);
    const double q = static_cast<double>(c.num_attention_heads * c.head_dim),
                 kv = static_cast<double>(c.num_key_value_heads * c.head_dim);
    params = vocab * d * (c.tie_word_embeddings ? 1 : 2) +
             layers * (2 * d * q + 2 * d * kv + 3 * d * static_cast<double>(c.intermediate_size) + 2 * d) + d;
  }
  // ranks on this host: torchrun's LOCAL_WORLD_SIZE (dmuon's launcher sets it too), else all of them
  // (a whole number only: "nan" made the estimate NaN and turned the check off; another value counts every rank)
  const char* lws = std::getenv("LOCAL_WORLD_SIZE");
  const std::optional<int64_t> lws_count = env::parse_count(lws ? lws : "", int64_t{1} << 20);
  const double local = std::clamp(lws_count ? static_cast<double>(*lws_count) : static_cast<double>(world), 1.0,
                                  static_cast<double>(world));
  const double share = local / world;
  const double state = params * (a.param_dtype == "fp64" ? 32 : 16) * share;
  const double tokens = static_cast<double>(a.batch) / a.grad_accum * a.tp * static_cast<double>(a.seq_len) * share;
  const double activations = tokens * (layers * d * 8 + vocab * 2) * 4;
  const double batches = local * static_cast<double>(a.batch) * static_cast<double>(a.seq_len + 1) * 8;
  const double need = state + activations + batches;
  const double have = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGE_SIZE));
  if (have > 0 && need > have) {
    std::ostringstream m;
    m << "this run needs at least " << gib(need) << " of memory (" << std::setprecision(3) << params
      << " parameters with gradients and optimizer state: " << gib(state) << "; activations of one micro-batch: "
      << gib(activations) << "; the global batch on each of " << local << " local rank(s): " << gib(batches)
      << "), but this machine has " << gib(have)
      << "; use smaller --layers/--d-model (or config sizes), --batch or --seq-len, or more --grad-accum";
    bad(m.str());
  }
}

// Checks that need no process group: done once in the parent, again in every rank.
void validate(const TrainArgs& a, int world) {
  if (world < 1) bad("--ranks must be >= 1 (got " + std::to_string(world) + ")");
  if (world > 64) bad("--ranks " + std::to_string(world) + " is more than this local launcher supports (64)");
  if (a.steps < 1) bad("--steps must be >= 1 (got " + std::to_string(a.steps) + ")");
  if (a.batch < 1) bad("--batch must be >= 1 (got " + std::to_string(a.batch) + ")");
  if (a.tp < 1 || world % a.tp != 0)
    bad("--tp " + std::to_string(a.tp) + " must divide the number of ranks " + std::to_string(world) +
        " (ranks = replicate x shard x tp)");
  const int dp = world / a.tp;  // data-parallel ranks: each TP group sees the same sequences
  const std::string dp_what = a.tp > 1 ? " data-parallel ranks (--ranks / --tp)" : " ranks";
  if (dp > a.batch)
    bad((a.tp > 1 ? std::to_string(dp) + dp_what : "--ranks " + std::to_string(world)) +
        " is larger than the global batch --batch " + std::to_string(a.batch) +
        ": every data-parallel rank needs at least one sequence");
  if (a.batch % dp != 0)
    bad("the global batch --batch " + std::to_string(a.batch) + " does not split evenly across " +
        std::to_string(dp) + dp_what + "; pick a batch that is a multiple of " + std::to_string(dp));
  const int64_t per = a.batch / dp;
  if (a.grad_accum < 1) bad("--grad-accum must be >= 1 (got " + std::to_string(a.grad_accum) + ")");
  if (per % a.grad_accum != 0)
    bad("--grad-accum " + std::to_string(a.grad_accum) + " must divide the per-rank batch " + std::to_string(per) +
        " (--batch " + std::to_string(a.batch) + " over " + std::to_string(dp) + dp_what + ")");
  if (a.seq_len < 2) bad("--seq-len must be >= 2 (got " + std::to_string(a.seq_len) + ")");
  if (a.layers < 1) bad("--layers must be >= 1 (got " + std::to_string(a.layers) + ")");
  if (a.heads < 1) bad("--heads must be >= 1 (got " + std::to_string(a.heads) + ")");
  if (a.d_model < 1) bad("--d-model must be >= 1 (got " + std::to_string(a.d_model) + ")");
  if (a.hf_config.empty() && a.d_model % a.heads != 0)
    bad("--d-model " + std::to_string(a.d_model) + " must be a multiple of --heads " + std::to_string(a.heads));
  if (a.log_every < 1) bad("--log-every must be >= 1 (got " + std::to_string(a.log_every) + ")");
  // the one range check of every hyperparameter (Muon's own, also applied to a checkpoint's values)
  check_hyperparameter("--lr", a.lr, HparamRange::NonNegative);
  check_hyperparameter("--adamw-lr", a.adamw_lr, HparamRange::NonNegative);
  check_hyperparameter("--weight-decay", a.weight_decay, HparamRange::NonNegative);
  if (!(a.val_fraction >= 0 && a.val_fraction < 1)) bad("--val-fraction must be in [0, 1)");
  if (a.port < 0 || a.port > 65535)
    bad("--port " + std::to_string(a.port) + " is out of range 1-65535 (0, or leave it unset, for a free port)");
  if (!(a.timeout_s > 0 && a.timeout_s <= 7 * 24 * 3600.0)) bad("--timeout must be > 0 seconds (and at most a week)");
  if (a.replicate < 1 || dp % a.replicate != 0)
    bad("--replicate " + std::to_string(a.replicate) + " must divide the number of data-parallel ranks " +
        std::to_string(dp) + (a.tp > 1 ? " (--ranks / --tp)" : ""));
  if (a.tp > 1 && a.hf_config.empty() && a.heads % a.tp != 0)
    bad("--tp " + std::to_string(a.tp) + " must divide --heads " + std::to_string(a.heads) +
        " (q/k/v are split over the TP ranks by heads)");
  if (a.checkpoint_every < 0) bad("--checkpoint-every must be >= 0");
  if (a.eval_every < 0) bad("--eval-every must be >= 0 (0 = never)");
  if (a.eval_every > 0 && !(a.val_fraction > 0 && a.val_fraction < 1))
    bad("--val-fraction must be in (0, 1) when --eval-every is on (got " + std::to_string(a.val_fraction) + ")");
  if (a.eval_batches < 1) bad("--eval-batches must be >= 1");
  if (!a.data.empty()) check_input_file("--data", a.data);
  if (!a.hf_config.empty()) check_input_file("--hf-config", a.hf_config);
  if (!a.init_from.empty()) {
    check_input_file("--init-from", a.init_from);
    if (is_dmuon_checkpoint(a.init_from))
      bad("--init-from " + a.init_from + " is a dmuon checkpoint (model and optimizer state), not a weights file; "
          "continue that run with --resume " + a.init_from + ", or export its weights with --export-safetensors");
  }
  if (!a.resume.empty()) check_input_file("--resume", a.resume);
  if (!a.resume.empty() && !a.init_from.empty())
    bad("--init-from and --resume both set the weights; --resume continues a run (its weights and optimizer "
        "state), --init-from starts a new one: pass one of them");
  if (!a.compare.empty() && a.optimizer != "dmuon")
    bad("--compare adamw trains DMuon against AdamW itself; leave --optimizer out (or at dmuon)");
  if (!(a.clip_grad >= 0) || !std::isfinite(a.clip_grad)) bad("--clip-grad must be a finite number >= 0 (0 = off)");
  if (a.checkpoint_every > 0 && a.checkpoint.empty()) bad("--checkpoint-every needs --checkpoint PATH");
  if (!(std::isfinite(a.loss_scale_init) && a.loss_scale_init > 0))
    bad("--loss-scale-init must be a finite number > 0 (a power of two keeps the unscaled gradients exact)");
  if (a.loss_scale_growth_interval < 1) bad("--loss-scale-growth-interval must be >= 1");
  check_paths(a);
  check_memory(a, world);
  if ((a.param_dtype == "bf16" || a.param_dtype == "fp16") && a.device == "cpu") {
    // LibTorch builds differ in which 16-bit CPU kernels they have (1.13 has no float16 matmul)
    const auto t = a.param_dtype == "bf16" ? at::kBFloat16 : at::kHalf;
    try {
      at::ones({2, 2}, at::TensorOptions().dtype(t)).matmul(at::ones({2, 2}, at::TensorOptions().dtype(t)));
    } catch (const std::exception&) {
      bad("--param-dtype " + a.param_dtype + ": this LibTorch has no " + a.param_dtype + " matrix multiply on the "
          "CPU; use --param-dtype bf16 (or fp32) on --device cpu, or --device cuda");
    }
  }
  if (a.device == "cuda" && !process_group_available(c10::DeviceType::CUDA))
    bad("--device cuda: this dmuon build has no CUDA/NCCL support (it was built against a CPU LibTorch); use "
        "--device cpu or rebuild against a CUDA LibTorch");
}

// The training split and the held-out tail (every rank splits the same way).
void split_text(const TrainArgs& a, const std::string& all, std::string& train, std::string& val) {
  if (a.eval_every == 0) {
    train = all;
    val.clear();
    return;
  }
  const size_t need = static_cast<size_t>(a.seq_len + 2);
  const size_t n_val = static_cast<size_t>(static_cast<double>(all.size()) * a.val_fraction);
  if (n_val < need || all.size() - n_val < need)
    throw std::invalid_argument("the text (" + std::to_string(all.size()) + " bytes) is too short to hold out " +
                                std::to_string(a.val_fraction) + " of it for validation with --seq-len " +
                                std::to_string(a.seq_len) + " (each split needs " + std::to_string(need) +
                                " bytes); use a longer --data, a larger --val-fraction, or --eval-every 0");
  train = all.substr(0, all.size() - n_val);
  val = all.substr(all.size() - n_val);
}

// collective: the mean next-token loss over --eval-batches fixed global batches of held-out text
// (the same batches at every evaluation), each rank its data-parallel slice, without gradients.
double evaluate(const TrainArgs& a, TrainRun& r) {
  Mesh* mesh = r.mesh.get();
  const int dp_rank = mesh->replicate_rank() * mesh->shard_size() + mesh->shard_rank();
  const int64_t per = a.batch / mesh->data_parallel_size(), micro = per / a.grad_accum;
  double sum = 0;
  {
    at::NoGradGuard ng;
    for (int i = 0; i < a.eval_batches; ++i) {
      const at::Tensor batch = sample_batch(r.val_text, a.batch, a.seq_len, a.seed + 0x5EED, i).to(r.device);
      const at::Tensor mine = batch.narrow(0, dp_rank * per, per);
      for (int m = 0; m < a.grad_accum; ++m) sum += r.model->loss(mine.narrow(0, m * micro, micro)).item<double>();
    }
  }
  at::Tensor l = at::tensor({sum / (a.eval_batches * a.grad_accum)}, at::kDouble).to(r.device);
  r.trainer->allreduce(l, Reduction::Avg, "validation loss").wait();
  return l.cpu().item<double>();
}

// Weights read from a file (--init-from, --resume), each value checked as it is read (each rank its
// share): a NaN, an inf or a magnitude no trained model has is an error naming the tensor, before
// step 1, instead of a loss of NaN or a gradient norm of 1e21 later.
class CheckedSource : public ParamSource {
 public:
  static constexpr double kMaxMagnitude = 1e6;
  CheckedSource(std::shared_ptr<ParamSource> inner, std::string what) : inner_(std::move(inner)), what_(std::move(what)) {}
  void check(const std::vector<std::pair<std::string, std::vector<int64_t>>>& params) override { inner_->check(params); }
  void fill(const std::string& name, const TensorRegion& region, at::Tensor& out) override {
    inner_->fill(name, region, out);
    if (!out.is_floating_point() || out.numel() == 0) return;
    const at::Tensor v = out.detach();
    const double hi = v.max().item<double>(), lo = v.min().item<double>();  // NaN propagates; no copy of v
    if (!std::isfinite(hi) || !std::isfinite(lo))
      bad(what_ + ": tensor '" + name + "' holds " +
          std::to_string(at::logical_not(at::isfinite(v)).sum().item<int64_t>()) + " NaN or infinite value(s); the "
          "file is damaged or was written by a run that diverged");
    if (const double peak = std::max(std::abs(hi), std::abs(lo)); peak > kMaxMagnitude) {
      std::ostringstream m;
      m << what_ << ": tensor '" << name << "' holds a value of magnitude " << peak << " (above " << kMaxMagnitude
        << ", which no trained model's weights reach); the file is damaged or is not a model's weights";
      bad(m.str());
    }
  }
  std::string describe() const override { return inner_->describe(); }

 private:
  std::shared_ptr<ParamSource> inner_;
  std::string what_;
};

// What defines a run, stored in its checkpoints (metadata "dmuon.run.<key>") and compared on
// --resume: the architecture and optimizer, and the data and its sampling (digest, size, held-out
// split, seed, batch, sequence length; --allow-data-change accepts a change of those).
struct RunKey {
  std::string key, flag, value;
  bool data;  // a difference --allow-data-change accepts
};
std::vector<RunKey> run_identity(const TrainArgs& a, const TrainRun& r) {
  std::vector<RunKey> k;
  if (a.hf_config.empty()) {
    k.push_back({"model", "--hf-config", "gpt", false});
    k.push_back({"d_model", "--d-model", std::to_string(a.d_model), false});
    k.push_back({"layers", "--layers", std::to_string(a.layers), false});
    k.push_back({"heads", "--heads", std::to_string(a.heads), false});
  } else {
    std::ifstream in(a.hf_config, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    std::ostringstream crc;
    crc << "hf config.json crc32c " << std::hex << checkpoint_crc32c(text.data(), text.size());
    k.push_back({"model", "--hf-config", crc.str(), false});
  }
  k.push_back({"optimizer", "--optimizer", a.optimizer, false});
  // the data and how it is sampled (sample_batch: seed, step, batch, seq_len)
  k.push_back({"seq_len", "--seq-len", std::to_string(a.seq_len), true});
  k.push_back({"seed", "--seed", std::to_string(a.seed), true});
  k.push_back({"batch", "--batch", std::to_string(a.batch), true});
  std::ostringstream d;
  d << r.data_bytes << " bytes, crc32c " << std::hex << r.data_crc32c;
  k.push_back({"data", "--data", d.str(), true});
  k.push_back({"held_out", "--eval-every/--val-fraction",
               a.eval_every == 0 ? std::string("none") : std::to_string(a.val_fraction) + " of the text", true});
  return k;
}
// The loss scaler's state (metadata "dmuon.loss_scale.scale" / ".growth_tracker"): not part of what
// defines the run (a resume may turn scaling on or off), but a resumed fp16 run goes on at the scale it
// had reached instead of 2^16, which would skip steps until it backed off again.
constexpr const char* kLossScaleKey = "dmuon.loss_scale.scale";
constexpr const char* kGrowthTrackerKey = "dmuon.loss_scale.growth_tracker";
std::map<std::string, std::string> run_metadata(const TrainArgs& a, const TrainRun& r) {
  std::map<std::string, std::string> m;
  for (const RunKey& k : run_identity(a, r)) m["dmuon.run." + k.key] = k.value;
  if (r.scaler) {
    std::ostringstream scale;
    scale << std::setprecision(17) << r.scaler->get_scale();  // exact: a double round-trips in 17 digits
    m[kLossScaleKey] = scale.str();
    m[kGrowthTrackerKey] = std::to_string(r.scaler->growth_tracker());
  }
  return m;
}
// A safetensors file another tool wrote (no "crc32c" metadata); a format-2 dmuon file always has them.
bool safetensors_without_checksums(const std::string& path) {
  try {
    return !SafetensorsFile(path).metadata().count("crc32c");
  } catch (const std::exception&) {  // not safetensors
    return false;
  }
}
// --resume: the checkpoint's run must be this one (the data may differ with --allow-data-change).
void check_same_run(const TrainArgs& a, const TrainRun& r, const Checkpoint& ck, std::ostream& out) {
  std::string diffs;
  bool any = false, only_data = true;
  for (const RunKey& k : run_identity(a, r)) {
    auto it = ck.metadata.find("dmuon.run." + k.key);
    if (it == ck.metadata.end()) continue;
    any = true;
    if (it->second == k.value) continue;
    diffs += "\n  " + k.flag + ": checkpoint " + it->second + ", now " + k.value;
    only_data = only_data && k.data;
  }
  if (!any) {
    if (r.lead)
      out << "  note: " << a.resume << " records no run description (written by an older dmuon or by the library), "
          << "so its model, data and seed are not compared with this run's\n";
    return;
  }
  if (diffs.empty()) return;
  if (only_data && a.allow_data_change) {
    if (r.lead) out << "  --allow-data-change: resuming on other data than the checkpoint's run:" << diffs << "\n";
    return;
  }
  bad("--resume " + a.resume + " was written by another run; it differs in:" + diffs + "\nResume with the same "
      "values" + (only_data ? std::string(" (or pass --allow-data-change to continue on other data)") :
                              std::string(" (a changed model or optimizer cannot resume; start a new run with "
                                          "--init-from the exported weights)")));
}

// --resume: learning rates and weight decay are the checkpoint's, unless given (then logged as overrides).
void apply_overrides(const TrainArgs& a, TrainRun& r, std::ostream& out) {
  std::ostringstream note;
  for (auto& g : r.opt->param_groups()) {
    auto& o = static_cast<MuonGroupOptions&>(g.options());
    auto set = [&](bool given, const char* flag, const char* what, double now, double v, auto setter) {
      if (!given || now == v) return;
      note << "  " << flag << " " << v << " overrides the checkpoint's " << what << " " << now << " (group '"
           << o.group_name() << "')\n";
      setter(v);
    };
    if (o.is_muon()) {
      set(a.lr_given, "--lr", "Muon learning rate", o.lr(), a.lr, [&](double v) { o.lr(v); });
      set(a.weight_decay_given, "--weight-decay", "Muon weight decay", o.weight_decay(), a.weight_decay,
          [&](double v) { o.weight_decay(v); });
    } else {
      set(a.adamw_lr_given, "--adamw-lr", "AdamW learning rate", o.lr(), a.adamw_lr, [&](double v) { o.lr(v); });
    }
  }
  if (!r.lead) return;
  out << note.str();
  // the rates kept from the checkpoint (an overridden one is in the note above)
  const auto& gs = r.opt->param_groups();
  if (!a.lr_given && !a.adamw_lr_given)
    out << "  learning rates from the checkpoint: Muon " << gs[0].options().get_lr() << ", AdamW "
        << gs[1].options().get_lr() << " (--lr / --adamw-lr override them)\n";
  else if (!a.lr_given)
    out << "  Muon learning rate from the checkpoint: " << gs[0].options().get_lr() << " (--lr overrides it)\n";
  else if (!a.adamw_lr_given)
    out << "  AdamW learning rate from the checkpoint: " << gs[1].options().get_lr() << " (--adamw-lr overrides it)\n";
}

// --resume with loss scaling: the scale and growth tracker the checkpoint's run had reached.
void resume_loss_scale(const TrainArgs& a, TrainRun& r, const Checkpoint& ck, std::ostream& out) {
  const auto scale = ck.metadata.find(kLossScaleKey), tracker = ck.metadata.find(kGrowthTrackerKey);
  if (!r.scaler) return;  // scaling off now: a saved scale is not needed
  if (scale == ck.metadata.end() || tracker == ck.metadata.end()) {
    if (r.lead)
      out << "  loss scale: " << a.resume << " holds none (written without loss scaling or by an older dmuon); "
          << "starting at " << r.scaler->get_scale() << "\n";
    return;
  }
  double s = 0;
  int64_t t = 0;
  try {
    size_t used_s = 0, used_t = 0;
    s = std::stod(scale->second, &used_s);
    t = std::stoll(tracker->second, &used_t);
    TORCH_CHECK(used_s == scale->second.size() && used_t == tracker->second.size(), "trailing characters");
    TORCH_CHECK(t >= 0, "a negative growth tracker");
    // a smaller --loss-scale-growth-interval than the checkpoint's run had: grow at the next clean step
    r.scaler->load(s, std::min<int64_t>(t, a.loss_scale_growth_interval - 1));
  } catch (const std::exception& e) {
    bad("--resume " + a.resume + ": its loss scale \"" + scale->second + "\" / growth tracker \"" + tracker->second +
        "\" is not valid (" + error_text(e) + "); the file was not written by dmuon train. Resume with --loss-scale "
        "off, or from a checkpoint dmuon train wrote.");
  }
  if (r.lead)
    out << "  loss scale from the checkpoint: " << s << " after " << t << " clean step(s) in a row"
        << (t >= a.loss_scale_growth_interval ? " (>= --loss-scale-growth-interval: it grows at the next clean step)"
                                              : "")
        << "\n";
}

// --resume into the same --out: metrics.csv keeps the rows of the steps before this run's first.
std::string earlier_metrics(const TrainArgs& a, int first_step) {
  const std::string path = a.out + "/metrics.csv";
  std::ifstream in(path);
  if (!in) return "";
  std::string header, line, kept;
  std::getline(in, header);  // checked by check_paths
  while (std::getline(in, line) && !in.eof()) {  // (a last line without its newline: an append cut short)
    const long step = std::strtol(line.c_str(), nullptr, 10);
    if (step >= 1 && step < first_step) kept += line + "\n";
  }
  return kept;
}

// collective: every rank (mesh, dedicate_params, the checkpoint it resumes from).
TrainRun setup_run(const TrainArgs& a, std::ostream& out) {
  // peak live bytes per phase (summary.json's peak_memory_bytes); the CUDA caching allocator keeps its own
  if (a.device != "cuda") memory::install_counting_allocator();
  memory::PhaseScope setup_phase(memory::Phase::Setup);
  TrainRun r;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
  const c10::DeviceType dev_type = a.device == "cuda" ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  // fault injection for tests: DMUON_TEST_FAIL_AT=<rank>:0:stop stops that rank (SIGSTOP) before it connects
  if (const char* f = std::getenv("DMUON_TEST_FAIL_AT"); f && std::getenv("RANK"))
    if (std::string(f) == std::string(std::getenv("RANK")) + ":0:stop") ::raise(SIGSTOP);
  try {
    r.boot = bootstrap_from_environment(dev_type, timeout);
  } catch (const std::exception& e) {  // the phase and the flag that bounds it (the library names no phase)
    const char* rank = std::getenv("RANK");
    std::ostringstream m;
    m << "setup: rank " << (rank ? rank : "0") << " could not connect to the other ranks within --timeout "
      << a.timeout_s << " s (is a rank stopped, crashed or unreachable?): " << error_text(e);
    bad(m.str());
  }
  r.rank = r.boot.rank;
  r.world = r.boot.world_size;
  r.device = dev_type == c10::DeviceType::CUDA ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(r.boot.local_rank))
                                              : at::Device(at::kCPU);
  validate(a, r.world);
  r.lead = r.rank == 0;
  {
    const std::string all = load_text(a.data, static_cast<size_t>(a.seq_len + 2));
    r.data_bytes = all.size();
    r.data_crc32c = checkpoint_crc32c(all.data(), all.size());
    split_text(a, all, r.text, r.val_text);
  }
  r.baseline = unigram_entropy_nats(r.text);
  r.use_muon = a.optimizer == "dmuon";

  models::MeshSetup ms;
  ms.store = r.boot.store;
  ms.device = dev_type;
  ms.replicate = a.replicate;
  ms.tp = a.tp;
  ms.timeout = timeout;
  r.mesh = models::make_training_mesh(r.boot.world, ms);
  std::vector<int> ranks(static_cast<size_t>(r.world));
  std::iota(ranks.begin(), ranks.end(), 0);
  r.trainer = std::make_unique<Communicator>(r.boot.world, "trainer", ranks, timeout, nullptr);

  models::DedicatedGptSetup gs;
  gs.device = r.device;
  gs.param_dtype = a.param_dtype;
  gs.muon = r.use_muon;
  gs.z3 = a.mode == "z3";
  gs.shard_base = a.shard_base;
  std::shared_ptr<Mesh> tp_mesh = a.tp > 1 ? r.mesh : nullptr;
  at::manual_seed(a.seed);
  // deferred initialisation: each block is built and released at once; dedicate_params then fills
  // only what this rank keeps, from the seeded initialisation (the same on any mesh) or the weights
  // file (read by offset, each rank its own tensors and rows)
  const models::DeferredInit deferred{true, a.param_dtype == "fp64" ? at::kDouble : at::kFloat, r.device};
  if (!a.hf_config.empty()) {
    models::HFDecoderConfig hc = models::HFDecoderConfig::load(a.hf_config);
    hc.tp_mesh = tp_mesh;
    hc.deferred = deferred;
    r.model = std::make_shared<models::HFCausalLMImpl>(hc);
  } else {
    gs.config.vocab_size = 256;
    gs.config.d_model = a.d_model;
    gs.config.n_layers = a.layers;
    gs.config.n_heads = a.heads;
    gs.config.max_seq_len = a.seq_len;
    gs.config.tp_mesh = tp_mesh;
    gs.config.deferred = deferred;
    r.model = models::GPT(gs.config).ptr();
  }
  gs.param_source = a.init_from.empty()
                        ? models::init_source(*r.model, static_cast<uint64_t>(a.seed))
                        : std::make_shared<CheckedSource>(models::weights_source(a.init_from), "--init-from " + a.init_from);
  models::dedicate_model(*r.model, r.mesh, gs, tp_mesh != nullptr);
  MuonOptions opts;
  opts.lr = a.lr;
  opts.adamw_lr = a.adamw_lr;
  opts.weight_decay = a.weight_decay;
  opts.ns_backend = a.ns_backend;
  opts.record_step_profile = true;
  opts.group_prepare_ahead = !a.one_pass;
  if (a.per_param_optim) opts.fused = opts.foreach = false;
  // the first step's per-matrix NS lines (kernel, shape, time), rank 0's only, in the run's output
  opts.first_step_progress_log = r.lead && r.use_muon;
  opts.log = [&out](const std::string& line) { out << "  " << line << "\n"; };
  r.opt = std::make_unique<Muon>(r.model, opts);
  // fp16 gradients underflow without it (bf16 has fp32's range and needs none)
  if (a.loss_scale == "dynamic" || (a.loss_scale == "auto" && a.param_dtype == "fp16")) {
    GradScalerOptions so;
    so.init_scale = a.loss_scale_init;
    so.growth_interval = a.loss_scale_growth_interval;
    r.scaler.emplace(so);
  }

  if (r.lead) {
    make_out_dir(a);
    out << "dmuon train: " << r.world << " rank(s)"
        << (a.replicate > 1 ? " (HSDP " + std::to_string(a.replicate) + " x " +
                                  std::to_string(r.world / a.replicate / a.tp) + ")"
                            : std::string())
        << (a.tp > 1 ? " (tensor parallel " + std::to_string(a.tp) + ")" : std::string())
        << ", " << (r.use_muon ? "DMuon-" + std::string(a.mode == "z3" ? "Z3" : "Z2") : std::string("AdamW baseline"))
        << (a.param_dtype == "fp64"   ? ", fp64 throughout"
            : a.param_dtype != "fp32" ? ", " + a.param_dtype + " compute (fp32 masters)"
                                      : std::string())
        << ", " << r.model->describe() << ", batch " << a.batch << " x " << a.seq_len << " bytes, " << a.steps
        << " steps, data " << (a.data.empty() ? std::string("fortunes (default)") : a.data) << " (" << r.text.size()
        << " bytes" << (r.val_text.empty() ? std::string() : ", " + std::to_string(r.val_text.size()) + " held out")
        << ")\n";
    if (!a.init_from.empty()) out << "  initial weights from " << a.init_from << "\n";
    if (r.use_muon)
      out << "  " << r.opt->ns().describe(r.device.type()) << "; unigram baseline " << r.baseline << " nats/byte\n";
  }
  if (!a.resume.empty()) {  // every rank reads the file; the new owners take their matrices
    // a safetensors checkpoint (what --checkpoint writes) is read by offset: each rank only the model
    // tensors and rows it keeps; a format-2 file of an earlier dmuon is read and verified whole
    // read and checked on every rank, the outcome agreed: a rank that cannot read its copy (another host's
    // disk) fails every rank at once, not the others after --timeout in the load's collectives
    Checkpoint ck;
    agree_outcome(*r.trainer, "reading --resume " + a.resume, true, [&] {
      if (const char* f = std::getenv("DMUON_TEST_FAIL_AT"); f && std::string(f) == std::to_string(r.rank) + ":resume")
        throw std::runtime_error("injected read failure (DMUON_TEST_FAIL_AT)");
      ck = load_checkpoint(a.resume, /*include_model=*/false, a.allow_unverified);
      TORCH_CHECK(ck.optim, "--resume ", a.resume, ": the checkpoint has no optimizer state; write it with --checkpoint.");
      check_same_run(a, r, ck, out);
      TORCH_CHECK(ck.optim->steps_taken < a.steps, "--resume ", a.resume, ": the checkpoint is at step ",
                  ck.optim->steps_taken, ", so --steps ", a.steps,
                  " leaves nothing to do; --steps counts all steps, pass a larger one.");
    });
    if (r.lead && a.allow_unverified && safetensors_without_checksums(a.resume))
      out << "  note: " << a.resume << " has no checksums (another tool wrote it); loaded unverified "
          << "(--allow-unverified-checkpoint)\n";
    const std::string what = "--resume " + a.resume;
    CheckedSource source(checkpoint_model_source(a.resume, a.allow_unverified), what);
    set_model_state_dict(*r.model, source);
    set_optimizer_state_dict(*r.model, *r.opt, *ck.optim);
    r.first_step = static_cast<int>(r.opt->steps_taken()) + 1;
    apply_overrides(a, r, out);
    resume_loss_scale(a, r, ck, out);
    if (r.lead) {
      out << "  resumed from " << a.resume << " at step " << r.first_step - 1 << "\n";
      r.earlier_metrics = earlier_metrics(a, r.first_step);
      if (!r.earlier_metrics.empty()) out << "  " << a.out << "/metrics.csv keeps its rows before step " << r.first_step << "\n";
    }
  }
  return r;
}

// collective: the owners broadcast, rank 0 writes.
void write_checkpoint(const TrainArgs& a, TrainRun& r) {
  memory::PhaseScope phase(memory::Phase::Checkpoint);
  const TensorDict msd = get_model_state_dict(*r.model);
  const OptimizerStateDict osd = get_optimizer_state_dict(*r.model, *r.opt);
  const auto meta = run_metadata(a, r);
  // rank 0 writes, every rank learns whether it worked
  agree_outcome(*r.trainer, "writing the checkpoint " + a.checkpoint, r.lead, [&] { save_checkpoint(a.checkpoint, msd, &osd, meta); });
}

// collective: the full state dict (single-process names and shapes) as safetensors, written by rank 0.
void export_model(const TrainArgs& a, TrainRun& r, std::ostream& out) {
  const TensorDict msd = get_model_state_dict(*r.model);
  agree_outcome(*r.trainer, "--export-safetensors " + a.export_safetensors, r.lead, [&] {
    save_safetensors(a.export_safetensors, msd, {{"format", "pt"}, {"producer", "dmuon train"}});
    out << "  exported the model (" << msd.size() << " tensors) to " << a.export_safetensors << "\n";
  });
}

// rank 0: metrics.csv always, loss.svg at the end and every 50 logged steps
void write_outputs(const TrainArgs& a, const TrainRun& r, TrainLog& log, bool final_write) {
  if (!r.lead) return;
  // the first write makes the file (header, earlier rows); later ones append the new rows only -- but where the
  // file is gone or was replaced since (a link is never followed), it is made anew from what it held
  const std::string path = a.out + "/metrics.csv", rows = log.csv.str();
  bool appended = false;
  if (!log.csv_written.empty()) try {
      append_file_durably(path, rows, "writing " + path);
      appended = true;
    } catch (const std::exception&) {
    }
  log.csv_written += rows;
  if (!appended) write_file_atomic(path, log.csv_written);
  log.csv.str("");
  if (final_write || log.steps_logged.size() % 50 == 0)
    write_file_atomic(a.out + "/loss.svg",
                      curves_svg({{"train", log.steps_logged, log.losses, "#1f5fbf", false},
                                  {"validation", log.val_steps, log.val_losses, "#e08a00", true}},
                                 r.baseline,
                                 "dmuon train: " + a.optimizer + (r.use_muon ? " " + a.mode : "") + ", " +
                                     std::to_string(r.world) + " ranks"));
}

// collective: every rank, each step (forward/backward, step, the loss average, checkpoints).
void train_loop(const TrainArgs& a, TrainRun& r, TrainLog& log, std::ostream& out) {
  const int rank = r.rank, first_step = r.first_step;
  const bool lead = r.lead;
  Mesh* mesh = r.mesh.get();
  Muon& opt = *r.opt;
  auto& model = r.model;
  // the batch is split over the data-parallel ranks; the T ranks of a TP group take the same slice
  const int dp_rank = mesh->replicate_rank() * mesh->shard_size() + mesh->shard_rank();
  const int64_t per = a.batch / mesh->data_parallel_size(), micro = per / a.grad_accum;
  log.csv << kMetricsHeader << "\n" << r.earlier_metrics;
  const bool tty = ::isatty(STDOUT_FILENO);
  log.t_start = std::chrono::steady_clock::now();
  // Fault injection for tests of the launcher: DMUON_TEST_FAIL_AT=<rank>:<step> makes that rank fail
  // at the start of that step, as a crash of one rank in a real run would; <rank>:<step>:kill makes
  // it die by SIGKILL there instead (no last words, as under the OOM killer or kill -9).
  int fail_rank = -1, fail_step = -1;
  char how[8] = "";
  if (const char* f = std::getenv("DMUON_TEST_FAIL_AT"))
    if (std::sscanf(f, "%d:%d:%7s", &fail_rank, &fail_step, how) < 2) fail_rank = -1;
  std::optional<GradScaler>& scaler = r.scaler;
  for (int step = first_step; step <= a.steps; ++step) {
    if (rank == fail_rank && step == fail_step && std::string(how) == "kill") ::raise(SIGKILL);
    if (rank == fail_rank && step == fail_step)
      throw std::runtime_error("injected failure at step " + std::to_string(step) + " (DMUON_TEST_FAIL_AT)");
    const auto t0 = std::chrono::steady_clock::now();
    mesh->counters().reset();
    opt.zero_grad();
    const at::Tensor batch = sample_batch(r.text, a.batch, a.seq_len, a.seed, step).to(r.device);
    const at::Tensor mine = batch.narrow(0, dp_rank * per, per);
    double loss_sum = 0, f_ms = 0, b_ms = 0;
    for (int m = 0; m < a.grad_accum; ++m) {
      // every micro-batch but the last accumulates locally; the last backward reduces the sum once
      std::optional<NoSync> accumulate;
      if (m + 1 < a.grad_accum) accumulate.emplace(*model);
      const auto tf = std::chrono::steady_clock::now();
      at::Tensor loss;
      {
        memory::PhaseScope phase(memory::Phase::Forward);
        loss = model->loss(mine.narrow(0, m * micro, micro)) / a.grad_accum;
      }
      const auto tb = std::chrono::steady_clock::now();
      {
        memory::PhaseScope phase(memory::Phase::Backward);
        (scaler ? scaler->scale(loss) : loss).backward();
      }
      const auto te = std::chrono::steady_clock::now();
      f_ms += std::chrono::duration<double, std::milli>(tb - tf).count();
      b_ms += std::chrono::duration<double, std::milli>(te - tb).count();
      loss_sum += loss.item<double>();
    }
    // the global gradient norm (each element once, every layout), clipped when --clip-grad is set
    GradClipOptions clip;
    clip.scope = ClipScope::AllParams;
    std::optional<memory::PhaseScope> step_phase(std::in_place, memory::Phase::Step);
    if (scaler) scaler->unscale_(opt);  // the norm and the clip of the true gradients
    const MuonGradClipStats cs =
        opt.clip_grad_norm_(a.clip_grad > 0 ? std::optional<double>(a.clip_grad) : std::nullopt, clip);
    log.grad_norms.push_back(cs.total_norm);
    log.clipped_steps += cs.clipped ? 1 : 0;
    if (scaler) {
      log.skipped_steps += scaler->step(opt) ? 0 : 1;
      scaler->update();
      log.loss_scale = scaler->get_scale();
    } else {
      opt.step();
    }
    step_phase.reset();
    const StepProfile prof = opt.consume_last_step_profile();
    // global mean loss over the whole batch: the ranks' means averaged (equal slices)
    at::Tensor l = at::tensor({loss_sum}, at::kDouble).to(r.device);
    r.trainer->allreduce(l, Reduction::Avg, "train loss").wait();
    const double gl = l.cpu().item<double>();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const double bytes = static_cast<double>(mesh->counters().snapshot().total_bytes());
    log.step_ms.push_back(ms);
    log.fwd_ms.push_back(f_ms);
    log.bwd_ms.push_back(b_ms);
    log.ns_ms.push_back(prof.ns_ms);
    log.adamw_ms.push_back(prof.adamw_ms);
    log.prep_ms.push_back(prof.prepare_ms);
    log.wait_ms.push_back(mesh->counters().wait_ms());
    log.bytes_per_step.push_back(bytes);
    log.muon_bytes_per_step.push_back(static_cast<double>(mesh->counters().bytes(CommOp::Broadcast) +
                                                      mesh->counters().bytes(CommOp::Reduce)));
    // after the step's bytes are taken: validation is not part of the step
    double val = std::nan("");
    if (!r.val_text.empty() && (step % a.eval_every == 0 || step == a.steps)) {
      val = evaluate(a, r);
      log.val_steps.push_back(step);
      log.val_losses.push_back(val);
    }
    if (lead) {
      log.steps_logged.push_back(step);
      log.losses.push_back(gl);
      const double tok_s = static_cast<double>(a.batch * a.seq_len) / (ms / 1000.0);
      log.csv << step << "," << std::setprecision(17) << gl << std::setprecision(6) << "," << opt.param_groups()[0].options().get_lr() << ","
          << opt.param_groups()[1].options().get_lr() << "," << ms << "," << tok_s << "," << bytes << ","
          << std::setprecision(17) << cs.total_norm << ",";
      if (std::isfinite(val)) log.csv << val;
      log.csv << std::setprecision(6) << "\n";
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - log.t_start).count();
      const double eta = elapsed / (step - first_step + 1) * (a.steps - step);
      const int width = 24, fill = static_cast<int>(static_cast<double>(width) * step / a.steps);
      std::ostringstream bar;
      bar << "[" << std::string(fill, '#') << std::string(width - fill, '-') << "] step " << step << "/" << a.steps
          << "  loss " << std::fixed << std::setprecision(3) << gl << "  tok/s " << std::setprecision(0) << tok_s
          << (std::isfinite(val) ? "  val " + std::to_string(val).substr(0, 5) : std::string()) << "  ETA "
          << fmt_secs(eta);
      if (tty) {
        out << "\r" << bar.str() << std::flush;
        if (step == a.steps) out << "\n";
      } else if (step % a.log_every == 0 || step == first_step || step == a.steps) {
        out << bar.str() << "\n" << std::flush;
      }
      if (step % a.log_every == 0) write_outputs(a, r, log, false);
    }
    // after the step's time and bytes are taken: the checkpoint's collectives are not the step's
    if (!a.checkpoint.empty() && (step == a.steps || (a.checkpoint_every > 0 && step % a.checkpoint_every == 0)))
      write_checkpoint(a, r);
  }
  log.total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - log.t_start).count();
}

int run_rank(const TrainArgs& a, std::ostream& out) {
  TrainRun r = setup_run(a, out);
  try {
    TrainLog log;
    train_loop(a, r, log, out);
    if (!a.export_safetensors.empty()) export_model(a, r, out);
    const int rc = report(a, r, log, out);
    // the end of the run: no asynchronous publish left in flight, then every group torn down cleanly
    // (NCCL: communicators destroyed, no watchdog outliving the run)
    if (r.model && r.use_muon) wait_all_post_step_broadcasts(*r.model);
    r.mesh->shutdown();
    // rank 0 serves the store: it leaves last
    if (r.world > 1) leave_together(*r.trainer, r.boot.store, "train", a.timeout_s);
    r.trainer->shutdown();
    return rc;
  } catch (...) {
    // the error path: abort the groups so peers stuck in a collective with this rank fail within
    // their timeout and no NCCL watchdog kills this process after dmuon's message
    if (r.mesh) r.mesh->abort();
    if (r.trainer) r.trainer->abort();
    throw;
  }
}

}  // namespace train

int run_train_command(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  using namespace train;
  CLI::App app{"dmuon train: a small GPT on real text with dedicated-ownership Muon", "dmuon train"};
  TrainArgs a;
  add_options(app, a);
  if (auto rc = parse_args(app, args, out, err)) return *rc;
  a.lr_given = app.get_option("--lr")->count() > 0;
  a.adamw_lr_given = app.get_option("--adamw-lr")->count() > 0;
  a.weight_decay_given = app.get_option("--weight-decay")->count() > 0;
  try {
    if (!launched_as_rank()) {
      const LaunchFn launch = [&](const TrainArgs& b, const std::vector<std::string>& bargs) {
        check_out_dir(b);
        make_out_dir(b);  // first: --checkpoint / --export-safetensors may lie in it
        validate(b, b.ranks);
        std::string train_text, val_text;  // a missing or short file fails here, before any rank starts
        split_text(b, load_text(b.data, static_cast<size_t>(b.seq_len + 2)), train_text, val_text);
        if (!b.hf_config.empty()) {  // and a bad config, or one --tp cannot split
          const models::HFDecoderConfig hc = models::HFDecoderConfig::load(b.hf_config);
          if (hc.num_attention_heads % b.tp != 0 || hc.num_key_value_heads % b.tp != 0)
            throw std::invalid_argument("--tp " + std::to_string(b.tp) + " must divide the config's num_attention_heads " +
                                        std::to_string(hc.num_attention_heads) + " and num_key_value_heads " +
                                        std::to_string(hc.num_key_value_heads) + " (q/k/v are split by heads)");
        }
        if (b.ranks == 1) return run_rank(b, out);
        LaunchOptions lo;
        lo.ranks = b.ranks;
        lo.port = b.port;
        lo.args = bargs;
        lo.subcommand = "train";
        const int rc = launch_local_ranks(lo, err);
        if (rc != 0)  // ranks stopped mid-write leave temporaries beside their outputs
          for (const std::string& p : {b.checkpoint, b.export_safetensors, b.out + "/metrics.csv", b.out + "/loss.svg",
                                       b.out + "/summary.json"})
            if (!p.empty()) remove_stale_temporaries(p);
        return rc;
      };
      if (!a.compare.empty() && a.optimizer != "dmuon")
        bad("--compare adamw trains DMuon against AdamW itself; leave --optimizer out (or at dmuon)");
      return a.compare.empty() ? launch(a, args) : run_compare(a, args, launch, out);
    }
    if (!a.compare.empty())
      throw std::invalid_argument("--compare starts two trainings one after the other, which dmuon's own launcher "
                                  "does (--ranks N); under torchrun, run dmuon train twice (--optimizer dmuon and "
                                  "--optimizer adamw, same --seed) and compare their metrics.csv files");
    return run_rank(a, out);
  } catch (const std::exception& e) {
    const std::string msg = error_text(e);
    const char* r = std::getenv("RANK");
    err << "error" << (r ? std::string(" (rank ") + r + ")" : std::string()) << ": " << msg << "\n";
    return 1;
  }
}

}  // namespace dmuon::cli
