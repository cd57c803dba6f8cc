// plan_tool_test -- `dmuon plan` in process: reports, --json, and every bad-input path.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dmuon/files.h"
#include "dmuon/tools/model_specs.h"
#include "dmuon/owner_plan.h"
#include "dmuon/tools/step_simulator.h"
#include "cli_files.h"
#include "dmuon/ns_profile.h"
#include "plan_cmd.h"

namespace dmuon {
namespace {

using nlohmann::json;

struct Result {
  int rc;
  std::string out, err;
};

Result run(const std::vector<std::string>& args) {
  std::ostringstream out, err;
  const int rc = cli::run_plan_command(args, out, err);
  return {rc, out.str(), err.str()};
}

// A failure prints exactly one line "error: ..." to err, nothing to out, and exits non-zero.
void ExpectOneLineError(const Result& r, const std::string& needle) {
  EXPECT_NE(r.rc, 0);
  EXPECT_TRUE(r.out.empty()) << r.out;
  ASSERT_FALSE(r.err.empty());
  EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << "missing '" << needle << "' in: " << r.err;
}

class PlanToolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/dmuon_plan_tool_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    for (const char* v : {"DMUON_OWNER_STRATEGY", "DMUON_OWNER_COST_MODEL",
                          "DMUON_HSDP_COLUMN_BALANCE", "DMUON_OWNER_PACK_SMALL_PARAMS"}) {
      const char* cur = std::getenv(v);
      saved_.emplace_back(v, cur ? std::optional<std::string>(cur) : std::nullopt);
      ::unsetenv(v);
    }
  }
  void TearDown() override {
    std::filesystem::remove_all(dir_);
    for (const auto& [k, v] : saved_) {
      if (v) ::setenv(k.c_str(), v->c_str(), 1);
      else ::unsetenv(k.c_str());
    }
  }
  std::string write(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
  std::string dir_;
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

TEST_F(PlanToolTest, HelpAndListModels) {
  const Result h = run({"--help"});
  EXPECT_EQ(h.rc, 0);
  for (const char* flag : {"--shard", "--replicate", "--owner-strategy", "--owner-cost-model",
                           "--hsdp-column-balance", "--pack-small-params",
                           "--max-owners-per-group", "--hf-config", "--params", "--json",
                           "--include", "--exclude"})
    EXPECT_NE(h.out.find(flag), std::string::npos) << flag;
  const Result l = run({"--list-models"});
  EXPECT_EQ(l.rc, 0);
  for (const std::string& name : model_preset_names())
    EXPECT_NE(l.out.find(name), std::string::npos) << name;
}

TEST_F(PlanToolTest, TextReportHasLoadBoundsViolationsAndBytes) {
  const Result r = run({"llama3-8b", "--shard", "8"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(r.err.empty());
  for (const char* s : {"Muon targets 224", "allocation units 192", "G=8 shard x R=1",
                        "imbalance = makespan / lower bound = 1.000", "violations: none",
                        "per-slot load", "Z2 (shard axis)", "Z3 (shard axis)", "FSDP-equiv.",
                        "hook boundaries 32, concurrent roots per boundary 6..6",
                        "model.layers.0: payload 416.00 MiB"})
    EXPECT_NE(r.out.find(s), std::string::npos) << "missing '" << s << "' in:\n" << r.out;
  const OwnerPlan plan = plan_owners(select_muon_params(model_preset("llama3-8b")), 8, 1);
  EXPECT_NE(r.out.find("fingerprint " + format_fingerprint(plan.fingerprint)), std::string::npos);
  // HSDP adds the replicate axis.
  const Result h = run({"--model", "llama3-8b", "-G", "8", "-R", "4", "--show-slots", "0"});
  ASSERT_EQ(h.rc, 0) << h.err;
  EXPECT_NE(h.out.find("replicate (HSDP)"), std::string::npos);
  EXPECT_NE(h.out.find("(7,3)"), std::string::npos);  // all 32 slots listed
}

TEST_F(PlanToolTest, JsonHasTheDocumentedFieldsAndMatchesTheLibrary) {
  const Result r = run({"--model", "mixtral-8x7b", "--shard", "16", "--replicate", "2", "--json"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const json j = json::parse(r.out);
  const auto params = select_muon_params(model_preset("mixtral-8x7b"));
  const OwnerPlan plan = plan_owners(params, 16, 2);
  EXPECT_EQ(j["shard_size"], 16);
  EXPECT_EQ(j["replicate_size"], 2);
  ASSERT_EQ(j["params"].size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const json& p = j["params"][i];
    EXPECT_EQ(p["name"], params[i].name);
    EXPECT_EQ(p["shape"].get<std::vector<int64_t>>(), params[i].shape);
    EXPECT_EQ(p["owner"], json::array({plan.owners[i].shard, plan.owners[i].replicate}));
  }
  ASSERT_EQ(j["slots"].size(), 32u);
  for (size_t s = 0; s < 32; ++s) {
    EXPECT_EQ(j["slots"][s]["owner"],
              json::array({plan.slots[s].owner.shard, plan.slots[s].owner.replicate}));
    EXPECT_DOUBLE_EQ(j["slots"][s]["cost"].get<double>(), plan.slots[s].cost);
    EXPECT_EQ(j["slots"][s]["bytes"].get<int64_t>(), plan.slots[s].bytes);
  }
  EXPECT_DOUBLE_EQ(j["makespan"].get<double>(), plan.makespan);
  EXPECT_DOUBLE_EQ(j["lower_bound"].get<double>(), plan.lower_bound);
  EXPECT_TRUE(j["violations"].is_array());
  EXPECT_TRUE(j["violations"].empty());
  EXPECT_EQ(j["fingerprint"], format_fingerprint(plan.fingerprint));
  EXPECT_EQ(j["options"]["owner_strategy"], "lpt");
  EXPECT_EQ(j["units"].size(), plan.units.size());
  EXPECT_EQ(j["comm"]["boundaries"].size(), 32u);
  EXPECT_EQ(j["comm"]["muon_bytes"].get<int64_t>(), plan.total_bytes);
  EXPECT_NEAR(j["comm"]["per_rank"]["z3"]["mean"].get<double>() /
                  j["comm"]["fsdp_equivalent"]["z3"].get<double>(), 1.0, 1e-12);
  EXPECT_EQ(j["non_muon_params"].size(), model_preset("mixtral-8x7b").params.size() - params.size());
  // Same input, same bytes out.
  EXPECT_EQ(run({"--model", "mixtral-8x7b", "--shard", "16", "--replicate", "2", "--json"}).out,
            r.out);
}

TEST_F(PlanToolTest, OptionsFlagsAndEnvironment) {
  json j = json::parse(run({"gpt2-xl", "-G", "4", "--owner-strategy", "round_robin",
                            "--owner-cost-model", "numel", "--pack-small-params", "false",
                            "--max-owners-per-group", "3", "--json"}).out);
  EXPECT_EQ(j["options"]["owner_strategy"], "round_robin");
  EXPECT_EQ(j["options"]["owner_cost_model"], "numel");
  EXPECT_EQ(j["options"]["pack_small_params"], false);
  EXPECT_EQ(j["options"]["max_owners_per_group"], 3);
  EXPECT_EQ(j["units"].size(), 192u);
  // The seed's environment overrides apply when a flag is not given; a flag wins.
  ::setenv("DMUON_OWNER_STRATEGY", "rank0", 1);
  ::setenv("DMUON_HSDP_COLUMN_BALANCE", "0", 1);
  j = json::parse(run({"gpt2-small", "-G", "4", "-R", "2", "--pack-small-params", "0", "--json"}).out);
  EXPECT_EQ(j["options"]["owner_strategy"], "rank0");
  EXPECT_EQ(j["options"]["hsdp_column_balance"], false);
  ASSERT_EQ(j["violations"].size(), 1u);  // rank0 serializes all 4 matrices of every layer
  EXPECT_NE(j["violations"][0].get<std::string>().find("layer concurrency: 12 of 12 groups"),
            std::string::npos);
  for (const auto& p : j["params"]) EXPECT_EQ(p["owner"], json::array({0, 0}));
  j = json::parse(run({"gpt2-small", "-G", "4", "--owner-strategy", "lpt", "--json"}).out);
  EXPECT_EQ(j["options"]["owner_strategy"], "lpt");
  ::setenv("DMUON_OWNER_STRATEGY", "fastest", 1);
  ExpectOneLineError(run({"gpt2-small"}), "DMUON_OWNER_STRATEGY: 'fastest'");
}

TEST_F(PlanToolTest, HfConfigAndParamsFiles) {
  const std::string cfg = write("config.json", R"({
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16"})");
  const Result a = run({"--hf-config", cfg, "-G", "8", "--json"});
  ASSERT_EQ(a.rc, 0) << a.err;
  const Result b = run({"--model", "qwen2.5-7b", "-G", "8", "--json"});
  EXPECT_EQ(json::parse(a.out)["fingerprint"], json::parse(b.out)["fingerprint"]);
  EXPECT_EQ(json::parse(a.out)["params"][0]["name"], "model.layers.0.self_attn.q_proj.weight");

  const std::string params = write("params.json", R"([
    {"name": "enc.layers.0.attn.weight", "shape": [1024, 1024], "dtype": "bf16"},
    {"name": "enc.layers.0.mlp.weight", "shape": [4096, 1024], "dtype": "fp32"},
    {"name": "enc.layers.1.attn.weight", "shape": [1024, 1024]},
    {"name": "enc.norm.weight", "shape": [1024]},
    {"name": "out_proj.weight", "shape": [1024, 8192]}])");
  const Result p = run({"--params", params, "--shard", "2", "--json"});
  ASSERT_EQ(p.rc, 0) << p.err;
  const json j = json::parse(p.out);
  ASSERT_EQ(j["params"].size(), 4u);
  EXPECT_EQ(j["params"][1]["elem_bytes"], 4);
  EXPECT_EQ(j["params"][3]["group"], "out_proj.weight");
  EXPECT_EQ(j["non_muon_params"], json::array({"enc.norm.weight"}));
  // Name patterns replace the default predicate.
  const Result inc = run({"--params", params, "--include", "attn", "--json"});
  EXPECT_EQ(json::parse(inc.out)["params"].size(), 2u);
  const Result exc = run({"--params", params, "--exclude", "out_*", "--json"});
  EXPECT_EQ(json::parse(exc.out)["params"].size(), 3u);
  // Each --include takes one pattern, so a positional model may follow it.
  const Result pos = run({"--include", "experts", "--include", "q_proj", "mixtral-8x7b", "--json"});
  ASSERT_EQ(pos.rc, 0) << pos.err;
  EXPECT_EQ(json::parse(pos.out)["params"].size(), 32u * 25u);
}

TEST_F(PlanToolTest, BadInputIsOneLineErrorNeverACrash) {
  ExpectOneLineError(run({"--model", "llama9"}), "unknown preset 'llama9'");
  ExpectOneLineError(run({"llama9"}), "unknown preset 'llama9'");
  ExpectOneLineError(run({"llama3-8b", "--shard", "0"}), "--shard must be >= 1, got 0");
  ExpectOneLineError(run({"llama3-8b", "--shard=-4"}), "got -4");
  ExpectOneLineError(run({"llama3-8b", "--shard", "-4"}), "-4");
  ExpectOneLineError(run({"llama3-8b", "--replicate", "0"}), "--replicate must be >= 1, got 0");
  ExpectOneLineError(run({"llama3-8b", "-R", "-1"}), "-1");
  ExpectOneLineError(run({"llama3-8b", "--shard", "eight"}), "eight");
  ExpectOneLineError(run({"llama3-8b", "--shard", "99999999999"}), "99999999999");
  ExpectOneLineError(run({"llama3-8b", "--shard", "65536", "--replicate", "65536"}),
                     "4294967296");
  ExpectOneLineError(run({"llama3-8b", "--owner-strategy", "greedy"}),
                     "Invalid owner_strategy: 'greedy'");
  ExpectOneLineError(run({"llama3-8b", "--owner-cost-model", "flops"}), "'flops'");
  ExpectOneLineError(run({"llama3-8b", "--pack-small-params", "maybe"}), "'maybe'");
  ExpectOneLineError(run({"llama3-8b", "--max-owners-per-group", "0"}), "got 0");
  ExpectOneLineError(run({"llama3-8b", "--dtype", "int3"}), "--dtype: unknown dtype 'int3'");
  // the flag is named, not the parameter list it would have been applied to
  ExpectOneLineError(run({"--params", write("one.json", R"([{"name": "w", "shape": [4, 4]}])"), "--dtype", "fp7"}),
                     "--dtype: unknown dtype 'fp7' (use bf16, fp16, fp32, fp64 or fp8)");
  ExpectOneLineError(run({"llama3-8b", "--no-such-flag"}), "--no-such-flag");
  ExpectOneLineError(run({}), "no model given");
  ExpectOneLineError(run({"llama3-8b", "--params", "x.json"}), "more than one model");
  ExpectOneLineError(run({"--params", dir_ + "/missing.json"}), "cannot open");
  ExpectOneLineError(run({"--hf-config", dir_ + "/missing.json"}), "missing.json");

  const std::string bad = write("bad.json", "[{\"name\": \"a\", \"shape\": [2, 2]},\n{oops}]");
  ExpectOneLineError(run({"--params", bad}), "malformed JSON");
  ExpectOneLineError(run({"--hf-config", bad}), "malformed JSON");
  ExpectOneLineError(run({"--params", write("empty.json", "")}), "malformed JSON");
  ExpectOneLineError(run({"--params", write("zero.json",
                                            R"([{"name": "w", "shape": [4096, 0]}])")}),
                     "'w' has shape [4096,0]: dimension 0 is not >= 1");
  ExpectOneLineError(run({"--params", write("neg.json",
                                            R"([{"name": "w", "shape": [-5, 3]}])")}),
                     "dimension -5");
  ExpectOneLineError(run({"--params", write("obj.json", R"({"name": "w"})")}),
                     "expected a JSON array");
  ExpectOneLineError(run({"--hf-config", write("t5.json", R"({"model_type": "t5"})")}),
                     "unsupported model_type 't5'");
  ExpectOneLineError(run({"--hf-config", write("neg_cfg.json",
                                               R"({"model_type": "llama", "hidden_size": 0})")}),
                     "'hidden_size' must be a positive integer, got 0");
  // a boolean written as a string would have planned the other case silently
  const std::string llama = R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100, "tie_word_embeddings": "yes"})";
  ExpectOneLineError(run({"--hf-config", write("tie.json", llama)}),
                     "field 'tie_word_embeddings' must be true or false, got \"yes\"");
  // input files are checked before any is read: a FIFO blocked the read of --ns-profile / --hardware (the
  // profiled cost model reads them before the other checks), a directory read as empty JSON
  const std::string fifo = dir_ + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ExpectOneLineError(run({"llama3-8b", "--owner-cost-model", "profiled", "--ns-profile", fifo}),
                     "--ns-profile " + fifo + ": is not a regular file");
  ExpectOneLineError(run({"llama3-8b", "--owner-cost-model", "profiled", "--hardware", fifo}),
                     "--hardware " + fifo + ": is not a regular file");
  ExpectOneLineError(run({"llama3-8b", "--owner-cost-model", "profiled", "--ns-profile", dir_}),
                     "--ns-profile " + dir_ + ": is a directory");
  // --calibrate's device is checked before anything is measured (LibTorch's own parser printed a backtrace; "meta"
  // measured nothing and wrote a profile of it)
  for (const char* device : {"cuda:abc", "meta", "cpu:3", "cuda:"})
    ExpectOneLineError(run({"--params", write("one.json", R"([{"name": "w", "shape": [4, 4]}])"), "--calibrate",
                            dir_ + "/cal.json", "--device", device}),
                       "--device '" + std::string(device) + "': --calibrate measures the CPU (cpu) or a GPU");
}

// --calibrate's file replaces the old one whole or not at all, never through a link put at its temporary's name
TEST_F(PlanToolTest, OutputFilesAreWrittenAtomicallyAndNeverThroughALink) {
  const std::string target = dir_ + "/cal.json", precious = write("precious.txt", "keep me");
  const std::string tmp = dir_ + "/.cal.json.tmp-" + std::to_string(::getpid());
  std::filesystem::create_symlink(precious, tmp);
  write_file_atomically(target, "{\"new\": 1}\n", "--calibrate");
  std::ifstream kept(precious), written(target);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(kept), {}), "keep me");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(written), {}), "{\"new\": 1}\n");
  EXPECT_FALSE(std::filesystem::is_symlink(target));
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::symlink_status(tmp)));
  try {  // a directory that is not there: said, and nothing is left behind
    write_file_atomically(dir_ + "/no/such/dir/cal.json", "x", "--calibrate");
    ADD_FAILURE() << "accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("--calibrate: writing '" + dir_ + "/no/such/dir/cal.json' failed"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(PlanToolTest, MoeHfConfigReportsImbalanceAgainstSingleMatrices) {
  // DeepSeek-V2-Lite's config.json (the size fields): 27 layers, 64 routed experts [1408, 2048].
  const std::string cfg = write("dsv2.json", R"({
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "n_routed_experts": 64, "n_shared_experts": 2, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": null, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16"})");
  const Result r = run({"--hf-config", cfg, "-G", "64", "--json"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["params"].size(), 5207u);
  EXPECT_EQ(j["params"][4]["name"], "model.layers.0.mlp.gate_proj.weight");  // after 4 MLA mats
  // Packing every layer into one unit made this 2.3x the per-matrix plan while reporting 1.000.
  const double makespan = j["makespan"].get<double>(), total = j["total_cost"].get<double>();
  EXPECT_DOUBLE_EQ(j["lower_bound"].get<double>(),
                   std::max(total / 64, j["largest_param_cost"].get<double>()));
  EXPECT_NEAR(j["imbalance"].get<double>(), makespan / (total / 64), 1e-12);
  EXPECT_LE(j["imbalance"].get<double>(), 1.011);
  const json& pk = j["packing"];
  EXPECT_EQ(pk["mode"], "capped");
  EXPECT_GT(pk["packed_units"].get<int>(), 0);
  EXPECT_LE(makespan, 1.01 * pk["per_matrix_makespan"].get<double>());
  PlanOptions off;
  off.pack_small_params = false;
  const auto params = select_muon_params(load_hf_config(cfg));
  EXPECT_DOUBLE_EQ(pk["per_matrix_makespan"].get<double>(),
                   plan_owners(params, 64, 1, off).makespan);
  // The text report says the same, against single matrices.
  const Result t = run({"--hf-config", cfg, "-G", "64"});
  ASSERT_EQ(t.rc, 0) << t.err;
  for (const char* s : {"= max(total/slots, largest matrix)", "imbalance = makespan / lower bound = 1.01",
                        "packing 521 packed units", "makespan / per-matrix plan's = 1.0065"})
    EXPECT_NE(t.out.find(s), std::string::npos) << "missing '" << s << "' in:\n" << t.out;
  // The MoE presets are listed and plan.
  const Result l = run({"--list-models"});
  for (const char* name : {"deepseek-v2-lite", "deepseek-v3", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b"})
    EXPECT_NE(l.out.find(name), std::string::npos) << name;
  const Result q = run({"qwen3-30b-a3b", "-G", "16", "--json"});
  ASSERT_EQ(q.rc, 0) << q.err;
  EXPECT_LE(json::parse(q.out)["imbalance"].get<double>(), 1.001);
  // Packing off: every matrix its own unit, and the report says so.
  const Result o = run({"--hf-config", cfg, "-G", "64", "--pack-small-params", "false"});
  EXPECT_NE(o.out.find("packing off"), std::string::npos) << o.out;
}

TEST_F(PlanToolTest, HugeSizesAreAClearErrorBeforePlanning) {
  // 100,000,000 layers used to build 900 million parameters and plan on without end.
  const std::string cfg = write("deep.json", R"({"model_type": "llama", "hidden_size": 4096,
    "num_hidden_layers": 100000000, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 14336, "vocab_size": 128256})");
  const auto t0 = std::chrono::steady_clock::now();
  const Result r = run({"--hf-config", cfg});
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ExpectOneLineError(r, "field 'num_hidden_layers' is 100000000, above the limit of 10000 layers");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("deep.json"), std::string::npos) << r.err;       // where
  EXPECT_NE(r.err.find("would not fit in memory"), std::string::npos);  // why
  EXPECT_NE(r.err.find("check the value"), std::string::npos);          // how to fix
  EXPECT_LT(s, 1.0);
  // Experts and widths have limits too; so has the product of sane-looking sizes.
  ExpectOneLineError(run({"--hf-config", write("wide.json", R"({"model_type": "qwen3_moe",
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
    "moe_intermediate_size": 768, "num_experts": 5000000, "vocab_size": 151936})")}),
                     "field 'num_experts' is 5000000, above the limit of 65536 experts");
  ExpectOneLineError(run({"--hf-config", write("many.json", R"({"model_type": "mixtral",
    "hidden_size": 64, "num_hidden_layers": 10000, "num_attention_heads": 4,
    "intermediate_size": 64, "num_local_experts": 60000, "vocab_size": 100})")}),
                     "above the limit of 2000000 tensors");
  // World size: checked before the model is even loaded.
  ExpectOneLineError(run({"llama3-8b", "--shard", "2097152"}),
                     "2097152 owner slots, above the limit of 1048576");
  ExpectOneLineError(run({"--hf-config", cfg, "--shard", "1024", "--replicate", "4096"}),
                     "4194304 owner slots, above the limit of 1048576");
}

TEST_F(PlanToolTest, EmptySelectionStillPlans) {
  const std::string params = write("vec.json", R"([{"name": "bias", "shape": [16]}])");
  const Result r = run({"--params", params, "--json"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_TRUE(j["params"].empty());
  EXPECT_EQ(j["slots"].size(), 8u);
  EXPECT_EQ(j["makespan"], 0.0);
}

}  // namespace
}  // namespace dmuon

namespace dmuon {
namespace {

TEST(PlanToolTp, MegatronSplitAndTpOwnersOnLlama) {
  const Result r = run({"llama3-8b", "-G", "8", "-T", "4", "--json"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const json j = json::parse(r.out);
  ASSERT_TRUE(j.contains("tp"));
  EXPECT_EQ(j["tp"]["tp_size"], 4);
  EXPECT_EQ(j["tp"]["num_slots"], 32);
  EXPECT_EQ(j["tp"]["column_parallel"], 32 * 5);  // q, k, v, gate, up per layer
  EXPECT_EQ(j["tp"]["row_parallel"], 32 * 2);     // o, down
  EXPECT_EQ(j["tp"]["whole"], 0);
  EXPECT_GE(j["tp"]["imbalance"].get<double>(), 1.0);
  std::vector<int> per_t(4, 0);
  for (const auto& p : j["params"]) {
    const std::string name = p["name"];
    const int t = p["tp_owner"];
    ASSERT_GE(t, 0);
    ASSERT_LT(t, 4);
    ++per_t[static_cast<size_t>(t)];
    if (name == "model.layers.0.self_attn.k_proj.weight") {  // [1024, 4096] split by rows: a 256-row slice
      EXPECT_EQ(p["tp_split_dim"], 0);
      EXPECT_EQ(p["shape"], json::array({256, 4096}));
    }
    if (name == "model.layers.0.mlp.down_proj.weight") {  // [4096, 14336] split by columns
      EXPECT_EQ(p["tp_split_dim"], 1);
      EXPECT_EQ(p["shape"], json::array({4096, 3584}));
    }
  }
  for (int n : per_t) EXPECT_GT(n, 0);  // every TP rank runs some full-matrix NS
  // the text report names the TP section
  const Result text = run({"llama3-8b", "-G", "8", "-T", "4"});
  ASSERT_EQ(text.rc, 0);
  EXPECT_NE(text.out.find("tensor parallelism (T = 4"), std::string::npos) << text.out;
  ExpectOneLineError(run({"llama3-8b", "--tp", "0"}), "--tp must be >= 1");
}

ParamSpec spec(const std::string& name, std::vector<int64_t> shape) {
  ParamSpec p;
  p.name = name;
  p.shape = std::move(shape);
  return p;
}

TEST(PlanToolTp, SplitRuleAndTheTpPlan) {
  const ParamSpec q = spec("model.layers.0.self_attn.q_proj.weight", {4096, 4096});
  const ParamSpec o = spec("model.layers.0.self_attn.o_proj.weight", {4096, 4096});
  const ParamSpec c = spec("transformer.h.0.attn.c_attn.weight", {768, 2304});
  const ParamSpec odd = spec("model.layers.0.mlp.up_proj.weight", {10, 4});
  EXPECT_EQ(megatron_tp_split_dim(q, 2), 0);
  EXPECT_EQ(megatron_tp_split_dim(o, 2), 1);
  EXPECT_EQ(megatron_tp_split_dim(c, 2), 1);
  EXPECT_EQ(megatron_tp_split_dim(odd, 4), -1);  // 10 rows do not split into 4
  EXPECT_EQ(megatron_tp_split_dim(q, 1), -1);
  // T = 1 is plan_owners, fingerprint included
  std::vector<ParamSpec> ps{q, o};
  EXPECT_EQ(plan_owners_tp(ps, 2, 1, 1).fingerprint, plan_owners(ps, 2, 1).fingerprint);
  ps[0].tp_split_dim = 0;
  ps[1].tp_split_dim = 1;
  const OwnerPlan tp = plan_owners_tp(ps, 1, 1, 2);
  // one DP slot, two TP owners: the two equal matrices go to different TP ranks
  EXPECT_NE(tp.tp_owners[0], tp.tp_owners[1]);
  EXPECT_DOUBLE_EQ(tp.tp_imbalance(), 1.0);
  EXPECT_NE(tp.fingerprint, plan_owners(ps, 1, 1).fingerprint);
  ps[0].tp_split_dim = 1;
  ps[0].shape = {4096, 4095};
  EXPECT_THROW(plan_owners_tp(ps, 1, 1, 2), std::invalid_argument);
}

// ---- the step simulator (--simulate) ---------------------------------------------------------------
// Round numbers: 1 TFLOP/s, mfu 0.5, NS efficiency 0.25, 10 GB/s links with 1 us latency, 100 GB/s memory.
HardwareSpec round_hardware() {
  return hardware_from_json(R"({"name": "round", "source": "test", "devices_per_node": 8, "matmul_tflops": 1,
    "mfu": 0.5, "ns_efficiency": 0.25, "memory_bandwidth_GBps": 100, "memory_GB": 80,
    "intra_node": {"bandwidth_GBps": 10, "latency_us": 1}, "inter_node": {"bandwidth_GBps": 1, "latency_us": 10}})",
                            "test");
}

ParamSpec bf16(const std::string& name, std::vector<int64_t> shape) {
  ParamSpec p;
  p.name = name;
  p.shape = std::move(shape);
  p.elem_bytes = 2;
  return p;
}

// Two layers of one [64, 256] matrix each (bf16) plus a [100, 64] embedding.
ModelSpec toy_model() {
  ModelSpec m;
  m.name = "toy";
  m.params = {bf16("model.embed_tokens.weight", {100, 64}), bf16("model.layers.0.mlp.up_proj.weight", {64, 256}),
              bf16("model.layers.1.mlp.up_proj.weight", {64, 256})};
  return m;
}

TEST(StepSimulator, TermsHaveTheirClosedForms) {
  // the toy model, G = 2: each matrix has its own owner, so each boundary's broadcast is one root of
  // S = 64*256*2 bytes
  const ModelSpec m = toy_model();
  const std::vector<ParamSpec> muon = select_muon_params(m);
  ASSERT_EQ(muon.size(), 2u);
  const OwnerPlan plan = plan_owners(muon, 2, 1);
  ASSERT_NE(plan.owners[0].shard, plan.owners[1].shard);
  SimLayout l;
  l.shard = 2;
  l.tokens = 1000;
  l.prefetch_depth = 0;  // no overlap: every collective is exposed
  const HardwareSpec hw = round_hardware();
  const Simulation sim = simulate_step(m, muon, plan, l, hw);
  ASSERT_EQ(sim.designs.size(), 4u);
  const StepEstimate& d = sim.designs[0];
  const double P = 100 * 64 + 2 * 64 * 256;
  EXPECT_DOUBLE_EQ(d.compute_s, 6 * P * 1000 / (2 * 1e12 * 0.5));
  // one rooted collective: 1 hop of latency + max(S, (G-1)/G S) / B
  const double S = 64 * 256 * 2, coll = 1e-6 + S / 10e9;
  // the replicated embedding's gradient all-reduce at the end of backward: 2 x (1 hop + (G-1)/G S_B / B)
  const double base = 2 * (1e-6 + 0.5 * 6400 * 2 / 10e9);
  // Z3: forward broadcast, backward broadcast + reduce, per boundary
  EXPECT_NEAR(d.exposed_comm_s, 2 * 3 * coll + base, 1e-15);
  // NS: one matrix per slot, 5 steps of 4 m^2 n + 2 m^3 (m = 64, n = 256) at 1e12 * 0.25
  EXPECT_DOUBLE_EQ(ns_flops({64, 256}, 5), 5 * (4.0 * 64 * 64 * 256 + 2.0 * 64 * 64 * 64));
  EXPECT_DOUBLE_EQ(d.ns_s, ns_flops({64, 256}, 5) / (1e12 * 0.25));
  // AdamW on the replicated embedding: 32 bytes per parameter at 100 GB/s
  EXPECT_DOUBLE_EQ(d.adamw_s, 6400 * 32 / 100e9);
  // the step's non-finite verdict: an all-gather of 32 bytes per rank, 1 hop + (G-1)/G 2 x 32 / B
  EXPECT_DOUBLE_EQ(d.verdict_s, 1e-6 + 0.5 * 64 / 10e9);
  EXPECT_NEAR(d.step_s, d.compute_s + d.exposed_comm_s + d.ns_s + d.adamw_s + d.verdict_s, 1e-15);
  // bytes: Z3 moves 3 x (the other rank's matrix) over the shard axis, plus the base all-reduce and the verdict's
  // 32 bytes from the other rank
  EXPECT_DOUBLE_EQ(d.bytes_per_rank, 3 * S + 2.0 * 1 / 2 * 6400 * 2 + 32);
  // naive DP Muon: every rank runs NS on both matrices
  EXPECT_DOUBLE_EQ(sim.designs[2].ns_s, 2 * ns_flops({64, 256}, 5) / (1e12 * 0.25));
  // Z2: no backward broadcast
  l.z3 = false;
  EXPECT_NEAR(simulate_step(m, muon, plan, l, hw).designs[0].exposed_comm_s, 2 * 2 * coll + base, 1e-15);
  // with prefetch: forward hides boundary 1's broadcast under boundary 0's compute, backward hides
  // boundary 0's gather and boundary 1's reduce under boundary 1's and 0's compute (compute-bound here)
  l.z3 = true;
  l.prefetch_depth = 1;
  EXPECT_NEAR(simulate_step(m, muon, plan, l, hw).designs[0].exposed_comm_s, 3 * coll + base, 1e-15);
  // a broadcast from one root is root-bottlenecked: both matrices on one owner cost 2S / B per boundary
  // of two matrices, not (G-1)/G of it
  ModelSpec one;
  one.name = "one layer";
  one.params = {bf16("model.layers.0.a.weight", {64, 256}), bf16("model.layers.0.b.weight", {64, 256})};
  PlanOptions rank0;
  rank0.owner_strategy = "rank0";
  const std::vector<ParamSpec> mu1 = select_muon_params(one);
  SimLayout l1 = l;
  l1.shard = 4;
  l1.z3 = false;  // Z2, no prefetch: one forward broadcast and one backward reduce, both exposed
  l1.prefetch_depth = 0;
  const Simulation s1 = simulate_step(one, mu1, plan_owners(mu1, 4, 1, rank0), l1, hw);
  EXPECT_NEAR(s1.designs[0].exposed_comm_s, 2 * (2e-6 + 2 * S / 10e9), 1e-15);
}

TEST(StepSimulator, SharedCoresMakespanIsFairProcessorSharing) {
  // two cores, jobs of 1, 1, 1, 3: all four at half a core until t = 2 (the short ones done), then the
  // long one alone on a core for its last 2
  EXPECT_DOUBLE_EQ(shared_cores_makespan({3, 1, 1, 1}, 2), 4.0);
  EXPECT_DOUBLE_EQ(shared_cores_makespan({2, 2, 2}, 2), 3.0);  // n equal jobs: n w / C
  EXPECT_DOUBLE_EQ(shared_cores_makespan({5, 1}, 4), 5.0);     // fewer jobs than cores: the longest
  EXPECT_DOUBLE_EQ(shared_cores_makespan({}, 2), 0.0);
  EXPECT_THROW(shared_cores_makespan({1}, 0), std::invalid_argument);
}

// Ranks time-sharing a host's cores (a CPU box): the toy model, G = 2.
TEST(StepSimulator, RanksSharingCoresSlowComputeShareNsAndExposeEveryCollective) {
  const ModelSpec m = toy_model();
  const std::vector<ParamSpec> muon = select_muon_params(m);
  const OwnerPlan plan = plan_owners(muon, 2, 1);
  SimLayout l;
  l.shard = 2;
  l.tokens = 1000;
  l.prefetch_depth = 1;
  HardwareSpec hw = round_hardware();
  const Simulation own = simulate_step(m, muon, plan, l, hw);  // every device its own compute
  SimLayout no_overlap = l;
  no_overlap.prefetch_depth = 0;
  const Simulation exposed = simulate_step(m, muon, plan, no_overlap, hw);
  ASSERT_LT(own.designs[0].exposed_comm_s, exposed.designs[0].exposed_comm_s);  // prefetch hides something
  // more cores than ranks: nothing changes
  hw.cores_per_node = 4;
  const Simulation roomy = simulate_step(m, muon, plan, l, hw);
  for (size_t d = 0; d < 4; ++d) EXPECT_DOUBLE_EQ(roomy.designs[d].step_s, own.designs[d].step_s) << d;
  // a core per rank: the same compute and NS, but no idle core moves bytes under compute
  hw.cores_per_node = 2;
  const Simulation even = simulate_step(m, muon, plan, l, hw);
  EXPECT_DOUBLE_EQ(even.designs[0].compute_s, own.designs[0].compute_s);
  EXPECT_DOUBLE_EQ(even.designs[0].ns_s, own.designs[0].ns_s);
  for (size_t d = 0; d < 2; ++d)
    EXPECT_NEAR(even.designs[d].exposed_comm_s, exposed.designs[d].exposed_comm_s, 1e-15) << d;
  // two ranks on one core: compute and AdamW twice as long; the two owners' NS (one matrix each) run
  // one after the other, naive DP Muon's four matrices (two per rank) too
  hw.cores_per_node = 1;
  const Simulation one = simulate_step(m, muon, plan, l, hw);
  EXPECT_DOUBLE_EQ(one.designs[0].compute_s, 2 * own.designs[0].compute_s);
  EXPECT_DOUBLE_EQ(one.designs[0].adamw_s, 2 * own.designs[0].adamw_s);
  EXPECT_DOUBLE_EQ(one.designs[0].ns_s, 2 * own.designs[0].ns_s);
  EXPECT_DOUBLE_EQ(one.designs[2].ns_s, 2 * own.designs[2].ns_s);
  EXPECT_DOUBLE_EQ(one.designs[2].ns_s, 4 * ns_flops({64, 256}, 5) / (1e12 * 0.25));
  EXPECT_NEAR(one.designs[0].exposed_comm_s, exposed.designs[0].exposed_comm_s, 1e-15);
  EXPECT_NEAR(one.designs[0].forward_s + one.designs[0].backward_s,
              one.designs[0].compute_s + one.designs[0].exposed_comm_s, 1e-15);
  // the bytes do not depend on who computes
  EXPECT_DOUBLE_EQ(one.designs[0].bytes_per_rank, own.designs[0].bytes_per_rank);
  // DDP's bucket overlap (naive DP, round-robin) is not DMuon's prefetch: only saturated cores undo it
  hw.cores_per_node = 0;
  for (size_t d = 2; d < 4; ++d) {
    EXPECT_DOUBLE_EQ(exposed.designs[d].exposed_comm_s, own.designs[d].exposed_comm_s) << d;
    EXPECT_GT(even.designs[d].exposed_comm_s, own.designs[d].exposed_comm_s) << d;
  }
  // HSDP (G = 1, R = 2): the publish overlaps the next forward unless every core has a rank
  SimLayout hsdp = l;
  hsdp.shard = 1;
  hsdp.replicate = 2;
  const OwnerPlan plan12 = plan_owners(muon, 1, 2);
  const double lat = hw.inter_node.latency_us * 1e-6;  // one hop over R = 2
  // each rank holds one matrix owned by the other replica: 2 S replicate bytes (stage-2 reduce S, publish S)
  const double S = 64 * 256 * 2;
  ASSERT_EQ(plan_comm(muon, plan12).max_replicate(), 2 * S);
  // the stage-2 reduces go out in backward, each boundary's (S / 2: half the reduce) when the next
  // one's backward ends; boundary 0 ends backward, so both boundaries' run after it here
  const double stage2 = lat + S / 2 / 1e9;
  const double rep_own = simulate_step(m, muon, plan12, hsdp, hw).designs[0].replicate_s;
  EXPECT_NEAR(rep_own, 2 * stage2, 1e-15);
  {  // four boundaries, each's backward longer than a stage 2: only the last two outlast backward
    ModelSpec four = m;
    four.params.push_back(bf16("model.layers.2.mlp.up_proj.weight", {64, 256}));
    four.params.push_back(bf16("model.layers.3.mlp.up_proj.weight", {64, 256}));
    const std::vector<ParamSpec> mu4 = select_muon_params(four);
    const OwnerPlan plan4 = plan_owners(mu4, 1, 2);
    ASSERT_EQ(plan_comm(mu4, plan4).max_replicate(), 4 * S);
    const Simulation s4 = simulate_step(four, mu4, plan4, hsdp, hw);
    ASSERT_GT(s4.designs[0].backward_s / 4, stage2);
    EXPECT_NEAR(s4.designs[0].replicate_s, 2 * stage2, 1e-15);
  }
  // every core has a rank: nothing moves under compute, the reduce and the publish are exposed
  hw.cores_per_node = 2;
  const double rep_shared = simulate_step(m, muon, plan12, hsdp, hw).designs[0].replicate_s;
  EXPECT_NEAR(rep_shared, lat + 2 * S / 1e9, 1e-15);
  // a plan for another grid is refused, not misread
  EXPECT_THROW(simulate_step(m, muon, plan12, l, hw), std::invalid_argument);
}

// A model with no Muon matrix (no boundary) still computes: the step is its compute and the base.
TEST(StepSimulator, AModelWithoutMatricesKeepsItsCompute) {
  ModelSpec m;
  m.name = "embedding only";
  m.params = {bf16("model.embed_tokens.weight", {100, 64})};
  const std::vector<ParamSpec> muon = select_muon_params(m);
  ASSERT_TRUE(muon.empty());
  SimLayout l;
  l.shard = 2;
  l.tokens = 1000;
  const Simulation sim = simulate_step(m, muon, plan_owners(muon, 2, 1), l, round_hardware());
  for (const StepEstimate& d : sim.designs) {
    EXPECT_DOUBLE_EQ(d.compute_s, 6.0 * 6400 * 1000 / (2 * 1e12 * 0.5)) << d.design;
    EXPECT_GE(d.exposed_comm_s, 0.0) << d.design;
    EXPECT_NEAR(d.forward_s + d.backward_s, d.compute_s + d.exposed_comm_s, 1e-15) << d.design;
    EXPECT_GE(d.step_s, d.compute_s) << d.design;
    EXPECT_EQ(d.ns_s, 0.0) << d.design;
  }
}

TEST(StepSimulator, HardwareDescriptionsAndTheirErrors) {
  // a description written by hardware_to_json reads back equal, cores and NS profile included
  HardwareSpec h = round_hardware();
  h.cores_per_node = 2;
  NsProfile prof;
  prof.timings = {NsTiming{32, 32, 4, 8, 100.0, 400.0}};
  h.ns_profile = std::make_shared<const NsProfile>(prof);
  const HardwareSpec back = hardware_from_json(hardware_to_json(h), "round trip");
  EXPECT_EQ(back.name, h.name);
  EXPECT_EQ(back.cores_per_node, 2);
  EXPECT_EQ(back.devices_per_node, h.devices_per_node);
  EXPECT_DOUBLE_EQ(back.intra_node.latency_us, h.intra_node.latency_us);
  EXPECT_DOUBLE_EQ(back.inter_node.bandwidth_GBps, h.inter_node.bandwidth_GBps);
  ASSERT_TRUE(back.ns_profile);
  EXPECT_EQ(back.ns_profile->digest(), prof.digest());
  EXPECT_EQ(hardware_from_json(hardware_to_json(round_hardware()), "t").cores_per_node, 0);
  EXPECT_EQ(hardware_preset("cpu-2core").cores_per_node, 2);
  EXPECT_EQ(hardware_preset("h200").cores_per_node, 0);
  for (const char* bad : {"1.5", "-1", "0", "1e10"}) {
    std::string j = hardware_to_json(round_hardware());
    j.insert(j.find('{') + 1, std::string("\"cores_per_node\": ") + bad + ", ");
    try {
      hardware_from_json(j, "cores.json");
      ADD_FAILURE() << bad << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("cores_per_node"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("cores.json"), std::string::npos) << e.what();
    }
  }
  // devices_per_node is a whole count in range (1e10 was cast to int: -2147483648 per node; 2.7 became 2), and
  // the text fields are strings
  auto error_of_json = [](const std::string& edit, const std::string& value) {
    json j = json::parse(hardware_to_json(round_hardware()));
    j[edit] = json::parse(value);
    try {
      hardware_from_json(j.dump(), "hw.json");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  for (const char* bad : {"1e10", "2.7", "0"})
    EXPECT_NE(error_of_json("devices_per_node", bad).find("hw.json: \"devices_per_node\" must"), std::string::npos)
        << bad << ": " << error_of_json("devices_per_node", bad);
  EXPECT_NE(error_of_json("name", "5").find("hw.json: \"name\" must be a string, got 5"), std::string::npos);
  EXPECT_NE(error_of_json("source", "[1]").find("\"source\" must be a string"), std::string::npos);
  // an NS profile's counts are whole numbers in range and its text fields strings (1.5 rows were truncated,
  // ns_steps 4294967297 became 1, "5" threw a bare JSON type error)
  auto profile_error = [](const std::string& text) {
    try {
      ns_profile_from_json(text, "prof.json");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const std::string timing = R"("timings": [{"rows": 32, "cols": 32, "single_us": 10}])";
  EXPECT_EQ(profile_error("{" + timing + "}"), "accepted");
  EXPECT_NE(profile_error(R"({"ns_steps": "5", )" + timing + "}").find("prof.json: \"ns_steps\" must be a whole number"),
            std::string::npos);
  EXPECT_NE(profile_error(R"({"ns_steps": 4294967297, )" + timing + "}").find("\"ns_steps\" must be a whole number"),
            std::string::npos);
  EXPECT_NE(profile_error(R"({"device": 7, )" + timing + "}").find("\"device\" must be a string, got 7"),
            std::string::npos);
  EXPECT_NE(profile_error(R"({"timings": [{"rows": 1.5, "cols": 32, "single_us": 10}]})")
                .find("prof.json: timings[0]: \"rows\" must be a whole number"),
            std::string::npos);
  EXPECT_NE(profile_error(R"({"timings": [{"rows": 32, "cols": 32, "single_us": 10, "batch": 2.5, "batch_us": 9}]})")
                .find("\"batch\" must be a whole number"),
            std::string::npos);
  EXPECT_EQ(hardware_preset("H200").devices_per_node, 8);
  EXPECT_NE(hardware_preset("h200").source.find("estimate"), std::string::npos);
  EXPECT_GT(load_hardware("cpu-2core").matmul_tflops, 0);
  const std::string e1 = [] {
    try {
      hardware_from_json(R"({"devices_per_node": 8})", "my.json");
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  }();
  EXPECT_NE(e1.find("my.json"), std::string::npos) << e1;
  EXPECT_NE(e1.find("matmul_tflops"), std::string::npos) << e1;
  const std::string e2 = [] {
    try {
      load_hardware("a100-that-does-not-exist");
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  }();
  EXPECT_NE(e2.find("h200"), std::string::npos) << e2;
}

TEST_F(PlanToolTest, SimulateProjectsWithDefaultsAndSweeps) {
  // the issue's command: Llama-3-8B on 64 H200s with 4M tokens, no other argument
  Result r = run({"--model", "llama3-8b", "-G", "64", "--simulate"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto line = r.out.find("overhead");
  ASSERT_NE(line, std::string::npos) << r.out;
  EXPECT_NE(r.out.find('%', line), std::string::npos) << r.out;
  for (const char* want : {"64 x h200", "DMuon-Z3", "FSDP AdamW", "naive DP Muon", "round-robin Muon", "4194304"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
  r = run({"--model", "llama3-8b", "--simulate", "--sweep", "G=8,64,512", "--json"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const json j = json::parse(r.out);
  ASSERT_EQ(j["layouts"].size(), 3u);
  for (const auto& lay : j["layouts"]) {
    ASSERT_EQ(lay["designs"].size(), 4u);
    EXPECT_EQ(lay["designs"][0]["design"], "DMuon-Z3");
    const double dm = lay["designs"][0]["step_ms"], fs = lay["designs"][1]["step_ms"];
    EXPECT_NEAR(lay["overhead_vs_adamw"].get<double>(), dm / fs - 1, 1e-12);
    // naive DP Muon repeats every matrix's NS on every rank: never cheaper than DMuon's busiest owner
    EXPECT_GE(lay["designs"][2]["ns_ms"].get<double>(), lay["designs"][0]["ns_ms"].get<double>());
  }
  EXPECT_EQ(j["layouts"][2]["devices"], 512);
  ExpectOneLineError(run({"--model", "llama3-8b", "--simulate", "--sweep", "G=8,x"}), "--sweep");
  ExpectOneLineError(run({"--model", "llama3-8b", "--simulate", "--hardware", "tpu9"}), "h200");
}

}  // namespace
}  // namespace dmuon
