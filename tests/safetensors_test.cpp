// The safetensors reader and writer (safetensors.h) and the safetensors checkpoint layout
// (checkpoint.h): the bytes are the format's, every damage is an error naming the tensor, sharded
// index files resolve, and checkpoints round-trip and are verified.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dmuon/checkpoint.h"
#include "dmuon/safetensors.h"
#include "support/multirank.h"

namespace {

using namespace dmuon;
using dmuon::testing::error_of;
using json = nlohmann::json;

std::string temp_dir() { return dmuon::testing::fresh_temp_dir("dmuon-st"); }

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_raw(const std::string& path, const std::string& header, const std::string& data) {
  std::ofstream out(path, std::ios::binary);
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i, n >>= 8) out.put(static_cast<char>(n & 0xFF));
  out << header << data;
}

SafetensorsDict sample() {
  SafetensorsDict d;
  d["a.f32"] = at::arange(6, at::kFloat).reshape({2, 3}) / 7;
  d["b.f64"] = at::arange(5, at::kDouble) / 3;
  d["c.bf16"] = (at::arange(4, at::kFloat) - 1.5).to(at::kBFloat16);
  d["d.f16"] = (at::arange(3, at::kFloat) * 0.25).to(at::kHalf);
  d["e.i64"] = at::tensor(int64_t{-1234567890123}, at::kLong).reshape({});
  d["f.i32"] = at::arange(-2, 2, at::kInt);
  d["g.i16"] = at::arange(-3, 3, at::kShort);
  d["h.i8"] = at::arange(-4, 4, at::kChar);
  d["i.u8"] = at::arange(250, 256, at::kLong).to(at::kByte);
  d["j.bool"] = at::tensor({1, 0, 1}, at::kLong).to(at::kBool);
  d["k.empty"] = at::zeros({0, 4}, at::kFloat);
  return d;
}

TEST(Safetensors, EveryDtypeScalarsAndEmptyTensorsRoundTripWithMetadata) {
  const std::string dir = temp_dir(), path = dir + "/t.safetensors";
  const SafetensorsDict d = sample();
  save_safetensors(path, d, {{"format", "pt"}, {"note", "x"}});
  const SafetensorsFile f(path);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("note"), "x");
  ASSERT_EQ(f.keys().size(), d.size());
  for (const auto& [k, v] : d) {
    const at::Tensor t = f.load(k);
    EXPECT_EQ(t.scalar_type(), v.scalar_type()) << k;
    EXPECT_EQ(t.sizes(), v.sizes()) << k;
    EXPECT_TRUE(at::equal(t, v)) << k;
  }
  EXPECT_EQ(f.entry("e.i64").shape.size(), 0u);
  EXPECT_EQ(f.load("e.i64").item<int64_t>(), -1234567890123);
  EXPECT_EQ(load_safetensors(path).size(), d.size());
  std::filesystem::remove_all(dir);
}

TEST(Safetensors, TheBytesAreTheFormat) {
  const std::string dir = temp_dir(), path = dir + "/t.safetensors";
  SafetensorsDict d;
  d["w"] = at::arange(6, at::kFloat).reshape({3, 2});
  d["s"] = at::tensor({2.5}, at::kDouble).reshape({});
  save_safetensors(path, d, {{"format", "pt"}});
  const std::string b = read_all(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<unsigned char>(b[static_cast<size_t>(i)]);
  EXPECT_EQ((8 + n) % 8, 0u);  // the data starts aligned, as Python's writer pads it
  const json h = json::parse(b.substr(8, n));
  EXPECT_EQ(h["__metadata__"]["format"], "pt");
  // std::map order: "s" (8 bytes) then "w" (24 bytes)
  EXPECT_EQ(h["s"]["dtype"], "F64");
  EXPECT_EQ(h["s"]["shape"], json::array());
  EXPECT_EQ(h["s"]["data_offsets"], json({0, 8}));
  EXPECT_EQ(h["w"]["dtype"], "F32");
  EXPECT_EQ(h["w"]["shape"], json({3, 2}));
  EXPECT_EQ(h["w"]["data_offsets"], json({8, 32}));
  EXPECT_EQ(b.size(), 8 + n + 32);
  double s = 0;
  std::memcpy(&s, b.data() + 8 + n, 8);
  EXPECT_EQ(s, 2.5);
  float w[6];
  std::memcpy(w, b.data() + 8 + n + 8, 24);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(w[i], static_cast<float>(i));
  std::filesystem::remove_all(dir);
}

TEST(Safetensors, RowsAreReadByOffset) {
  const std::string dir = temp_dir(), path = dir + "/t.safetensors";
  const at::Tensor w = at::arange(20, at::kDouble).reshape({4, 5});
  save_safetensors(path, {{"w", w}});
  const SafetensorsFile f(path);
  EXPECT_TRUE(at::equal(f.load_rows("w", 1, 2), w.narrow(0, 1, 2)));
  EXPECT_EQ(f.load_rows("w", 4, 0).size(0), 0);
  EXPECT_NE(error_of([&] { f.load_rows("w", 3, 2); }).find("outside its 4 rows"), std::string::npos);
  EXPECT_NE(error_of([&] { f.load("nope"); }).find("has no tensor 'nope'"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(Safetensors, DamagedFilesAreErrorsThatNameTheFileAndTensor) {
  const std::string dir = temp_dir(), p = dir + "/bad.safetensors";
  auto err = [&](const std::string& header, const std::string& data) {
    write_raw(p, header, data);
    return error_of([&] { SafetensorsFile f(p); });
  };
  const std::string eight(8, '\0');
  EXPECT_EQ(err(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", eight), "");  // the good one
  EXPECT_NE(err("not json", eight).find("not JSON"), std::string::npos);
  EXPECT_NE(err(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight).find("tensor 'w' has 8 bytes"),
            std::string::npos);
  EXPECT_NE(err(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", eight).find("truncated or its header"),
            std::string::npos);
  EXPECT_NE(err(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                eight)
                .find("overlapping"),
            std::string::npos);
  EXPECT_NE(err(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight).find("a gap"), std::string::npos);
  EXPECT_NE(err(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", eight).find("4 bytes after its last"),
            std::string::npos);
  EXPECT_NE(err(R"({"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}})", eight).find("dtype C64"),
            std::string::npos);
  EXPECT_NE(err(R"({"__metadata__":{"k":1}})", "").find("not a string"), std::string::npos);
  // a shape whose byte count wraps in 64 bits (2^61 I64 = 2^64 bytes: 0 mod 2^64) names the tensor
  EXPECT_NE(err(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"z":{"dtype":"I64","shape":[2305843009213693952],"data_offsets":[8,8]}})",
                eight)
                .find("tensor 'z' has shape [2305843009213693952], whose I64 size overflows 64 bits"),
            std::string::npos);
  // values nested deeper than a recursive printer's stack (here 1M levels, 2 MB of header): quoted two levels
  // deep in the error, not a crash
  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  EXPECT_NE(err(R"({"w":)" + deep + "}", "").find(R"(needs "dtype", "shape" and "data_offsets", got [[[...]]])"),
            std::string::npos);
  EXPECT_NE(err(R"({"__metadata__":{"k":)" + deep + "}}", "").find("is not a string ([[[...]]]"), std::string::npos);
  {  // a header length beyond the file
    std::ofstream out(p, std::ios::binary);
    const char len[8] = {100, 0, 0, 0, 0, 0, 0, 0};
    out.write(len, 8);
    out << "{}";
  }
  EXPECT_NE(error_of([&] { SafetensorsFile f(p); }).find("is truncated"), std::string::npos);
  EXPECT_NE(error_of([&] { SafetensorsFile f(dir + "/missing.safetensors"); }).find("does not exist"),
            std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(Safetensors, ShardedIndexResolvesEveryTensorToItsFile) {
  const std::string dir = temp_dir();
  save_safetensors(dir + "/model-00001-of-00002.safetensors", {{"a", at::ones({2})}, {"b", at::zeros({3})}});
  save_safetensors(dir + "/model-00002-of-00002.safetensors", {{"c", at::full({4}, 2.0)}});
  json idx = {{"metadata", {{"total_size", 36}}},
              {"weight_map",
               {{"a", "model-00001-of-00002.safetensors"},
                {"b", "model-00001-of-00002.safetensors"},
                {"c", "model-00002-of-00002.safetensors"}}}};
  std::ofstream(dir + "/model.safetensors.index.json") << idx.dump();
  const SafetensorsDict d = load_safetensors(dir + "/model.safetensors.index.json");
  ASSERT_EQ(d.size(), 3u);
  EXPECT_TRUE(at::equal(d.at("c"), at::full({4}, 2.0)));
  for (const std::string& elsewhere : {dir + "/model-00002-of-00002.safetensors", std::string("../x.safetensors"),
                                       std::string("sub/../../x.safetensors")}) {  // a shard outside the index's dir
    idx["weight_map"]["c"] = elsewhere;
    std::ofstream(dir + "/out.safetensors.index.json") << idx.dump();
    EXPECT_NE(error_of([&] { load_safetensors(dir + "/out.safetensors.index.json"); })
                  .find("weight_map entry 'c' names '" + elsewhere + "', not a shard file beside the index"),
              std::string::npos)
        << elsewhere;
  }
  idx["weight_map"]["c"] = "model-00001-of-00002.safetensors";
  std::ofstream(dir + "/bad.safetensors.index.json") << idx.dump();
  EXPECT_NE(error_of([&] { load_safetensors(dir + "/bad.safetensors.index.json"); }).find("which does not hold it"),
            std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(Safetensors, CheckpointsRoundTripAndDamageNamesTheTensor) {
  const std::string dir = temp_dir(), path = dir + "/ck.safetensors";
  TensorDict model{{"layers.0.w", at::arange(12, at::kFloat).reshape({3, 4})}, {"norm.weight", at::ones({4})}};
  OptimizerStateDict o;
  o.muon["layers.0.w.momentum_buffer"] = at::arange(12, at::kFloat).reshape({3, 4}) / 10;
  o.muon["layers.0.w.step"] = at::tensor(int64_t{7}).reshape({});
  o.adamw["norm.weight.exp_avg"] = at::full({4}, 0.5);
  o.adamw["norm.weight.exp_avg_sq"] = at::full({4}, 0.25);
  o.adamw["norm.weight.step"] = at::tensor(int64_t{7}).reshape({});
  o.param_groups = {{"muon", true, 0.02, 0.95, 0.01, 0, 0, 0, true, 5},
                    {"adamw", false, 3e-3, 0, 0.1, 0.9, 0.95, 1e-8, false, 0}};
  o.steps_taken = 7;
  save_checkpoint(path, model, &o);
  const SafetensorsFile f(path);  // the layout other tools read
  EXPECT_EQ(f.metadata().at("format"), "dmuon-checkpoint-safetensors-v1");
  EXPECT_TRUE(f.contains("model/layers.0.w") && f.contains("optim_muon/layers.0.w.momentum_buffer") &&
              f.contains("optim_adamw/norm.weight.exp_avg_sq"));
  EXPECT_EQ(json::parse(f.metadata().at("optimizer"))["steps_taken"], 7);
  const Checkpoint ck = load_checkpoint(path);
  ASSERT_TRUE(ck.optim);
  EXPECT_TRUE(at::equal(ck.model.at("layers.0.w"), model.at("layers.0.w")));
  EXPECT_TRUE(at::equal(ck.optim->adamw.at("norm.weight.exp_avg_sq"), o.adamw.at("norm.weight.exp_avg_sq")));
  EXPECT_EQ(ck.optim->muon.at("layers.0.w.step").item<int64_t>(), 7);
  EXPECT_EQ(ck.optim->steps_taken, 7);
  ASSERT_EQ(ck.optim->param_groups.size(), 2u);
  EXPECT_EQ(ck.optim->param_groups[1].beta2, 0.95);
  EXPECT_EQ(ck.optim->param_groups[1].eps, 1e-8);
  EXPECT_EQ(ck.optim->param_groups[0].ns_steps, 5);
  // one flipped byte inside a tensor's data: the error names that tensor
  std::string b = read_all(path);
  const SafetensorsEntry& e = f.entry("optim_adamw/norm.weight.exp_avg");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<unsigned char>(b[static_cast<size_t>(i)]);
  b[8 + n + e.begin + 1] ^= 0x10;
  std::ofstream(path, std::ios::binary) << b;
  EXPECT_NE(error_of([&] { load_checkpoint(path); }).find("damage is in 'optim_adamw/norm.weight.exp_avg'"),
            std::string::npos);
  // a header length out of bounds (1e12) is reported as the safetensors file's, not as another format
  {
    std::string h = read_all(path);
    const uint64_t huge = 1000000000000ull;
    for (int i = 0; i < 8; ++i) h[static_cast<size_t>(i)] = static_cast<char>(huge >> (8 * i));
    std::ofstream(dir + "/long.safetensors", std::ios::binary) << h;
    const std::string err = error_of([&] { load_checkpoint(dir + "/long.safetensors"); });
    EXPECT_NE(err.find("announce a 1000000000000-byte header"), std::string::npos) << err;
  }
  // no "crc32c": refused unless allowed (another tool's file); a recorded tensor that is gone: refused
  {
    const std::string ok = dir + "/ok.safetensors";
    save_checkpoint(ok, model, &o);
    SafetensorsDict t = SafetensorsFile(ok).load_all();
    std::map<std::string, std::string> meta = SafetensorsFile(ok).metadata();
    meta.erase("crc32c");
    save_safetensors(dir + "/nocrc.safetensors", t, meta);
    EXPECT_NE(error_of([&] { load_checkpoint(dir + "/nocrc.safetensors"); }).find("has no \"crc32c\" metadata"),
              std::string::npos);
    EXPECT_EQ(load_checkpoint(dir + "/nocrc.safetensors", true, /*allow_unverified=*/true).optim->steps_taken, 7);
    meta = SafetensorsFile(ok).metadata();
    t.erase("optim_adamw/norm.weight.exp_avg_sq");
    save_safetensors(dir + "/gone.safetensors", t, meta);
    EXPECT_NE(error_of([&] { load_checkpoint(dir + "/gone.safetensors"); })
                  .find("records tensor 'optim_adamw/norm.weight.exp_avg_sq', which is not in the file"),
              std::string::npos);
    // the optimizer's metadata (learning rates, steps taken) edited and its checksum entry removed: refused, as a
    // tensor without one is; a checksum beyond 32 bits (crc + 2^32) is not one
    meta = SafetensorsFile(ok).metadata();
    t = SafetensorsFile(ok).load_all();
    json edited = json::parse(meta.at("optimizer"));
    edited["param_groups"][0]["lr"] = 0.5;
    meta["optimizer"] = edited.dump();
    json sums = json::parse(meta.at("crc32c"));
    sums.erase("optimizer");
    meta["crc32c"] = sums.dump();
    save_safetensors(dir + "/unsummed.safetensors", t, meta);
    EXPECT_NE(error_of([&] { load_checkpoint(dir + "/unsummed.safetensors"); })
                  .find("its \"optimizer\" metadata has no entry in its \"crc32c\" metadata"),
              std::string::npos);
    meta = SafetensorsFile(ok).metadata();
    sums = json::parse(meta.at("crc32c"));
    sums["model/norm.weight"] = sums["model/norm.weight"].get<uint64_t>() + (uint64_t{1} << 32);
    meta["crc32c"] = sums.dump();
    save_safetensors(dir + "/wide.safetensors", t, meta);
    EXPECT_NE(error_of([&] { load_checkpoint(dir + "/wide.safetensors"); })
                  .find("for 'model/norm.weight', which is not a CRC32C checksum"),
              std::string::npos);
  }
  // plain weights are not a checkpoint
  save_safetensors(dir + "/w.safetensors", {{"x", at::ones({1})}});
  EXPECT_NE(error_of([&] { load_checkpoint(dir + "/w.safetensors"); }).find("not a dmuon checkpoint"),
            std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace
