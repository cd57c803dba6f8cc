// cli_text.h -- byte-level text data for the training job, and small report writers.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dmuon::cli {

// The default corpus: the English text of Debian's fortunes package (fortunes-min).
extern const char* const kDefaultTextFiles[];

// Reads `path` (or the default corpus when empty) as bytes. Throws std::runtime_error with the
// path and the reason when it cannot, or when the text is shorter than `min_bytes`.
std::string load_text(const std::string& path, size_t min_bytes);

// Shannon entropy of the byte distribution of `text` in nats: the loss of the best model that
// ignores context (the unigram baseline).
double unigram_entropy_nats(const std::string& text);

// Global batch for `step`: `batch` windows of seq_len + 1 bytes at positions drawn from a
// generator seeded with (seed, step), identical on every rank. [batch, seq_len + 1] int64.
at::Tensor sample_batch(const std::string& text, int64_t batch, int64_t seq_len, uint64_t seed, int64_t step);

// A line chart of loss per step with the unigram baseline as a dashed line (SVG text).
std::string loss_svg(const std::vector<int64_t>& steps, const std::vector<double>& losses, double baseline,
                     const std::string& title);
// Several curves in one chart (legend when more than one), with the baseline; non-finite values
// are skipped.
struct Curve {
  std::string label;
  std::vector<int64_t> steps;
  std::vector<double> values;
  std::string color = "#1f5fbf";
  bool dashed = false;
};
std::string curves_svg(const std::vector<Curve>& curves, double baseline, const std::string& title);

}  // namespace dmuon::cli
