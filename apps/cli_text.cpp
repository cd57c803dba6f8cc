#include "cli_text.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>

namespace dmuon::cli {

const char* const kDefaultTextFiles[] = {"/usr/share/games/fortunes/fortunes", "/usr/share/games/fortunes/literature",
                                         "/usr/share/games/fortunes/riddles", nullptr};

namespace {
bool read_file(const std::string& path, std::string& out, std::string& why) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    why = "cannot open it";
    return false;
  }
  std::ostringstream ss;
  ss << f.rdbuf();
  out += ss.str();
  return true;
}
}  // namespace

std::string load_text(const std::string& path, size_t min_bytes) {
  std::string text, why;
  if (!path.empty()) {
    if (!read_file(path, text, why)) throw std::runtime_error("data file '" + path + "': " + why);
  } else {
    for (const char* const* p = kDefaultTextFiles; *p; ++p) read_file(*p, text, why);
    if (text.empty())
      throw std::runtime_error("the default training text (Debian's fortunes-min, /usr/share/games/fortunes) is not "
                               "installed; run scripts/install_deps.sh or pass --data FILE");
  }
  if (text.size() < min_bytes)
    throw std::runtime_error("data " + (path.empty() ? std::string("(default corpus)") : "'" + path + "'") + " has " +
                             std::to_string(text.size()) + " bytes; need at least " + std::to_string(min_bytes) +
                             " (sequence length + 2)");
  return text;
}

double unigram_entropy_nats(const std::string& text) {
  std::array<double, 256> c{};
  for (unsigned char ch : text) c[ch] += 1;
  double h = 0;
  for (double n : c)
    if (n > 0) {
      const double p = n / static_cast<double>(text.size());
      h -= p * std::log(p);
    }
  return h;
}

at::Tensor sample_batch(const std::string& text, int64_t batch, int64_t seq_len, uint64_t seed, int64_t step) {
  std::mt19937_64 gen(seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(step) + 1);
  const int64_t span = seq_len + 1;
  std::uniform_int_distribution<int64_t> pos(0, static_cast<int64_t>(text.size()) - span);
  at::Tensor out = at::empty({batch, span}, at::kLong);
  auto acc = out.accessor<int64_t, 2>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t p = pos(gen);
    for (int64_t t = 0; t < span; ++t) acc[b][t] = static_cast<unsigned char>(text[static_cast<size_t>(p + t)]);
  }
  return out;
}

std::string loss_svg(const std::vector<int64_t>& steps, const std::vector<double>& losses, double baseline,
                     const std::string& title) {
  return curves_svg({{"train", steps, losses, "#1f5fbf", false}}, baseline, title);
}

std::string curves_svg(const std::vector<Curve>& curves, double baseline, const std::string& title) {
  const double W = 720, H = 420, L = 60, R = 20, T = 40, B = 50;
  double ymax = baseline, ymin = baseline;
  int64_t last = 1;
  for (const Curve& c : curves) {
    for (double l : c.values) {
      if (!std::isfinite(l)) continue;
      ymax = std::max(ymax, l);
      ymin = std::min(ymin, l);
    }
    if (!c.steps.empty()) last = std::max(last, c.steps.back());
  }
  ymin = std::max(0.0, ymin - 0.1 * (ymax - ymin + 1e-9));
  ymax = ymax + 0.05 * (ymax - ymin + 1e-9);
  const double xmax = static_cast<double>(last);
  auto X = [&](double s) { return L + (W - L - R) * s / xmax; };
  auto Y = [&](double v) { return T + (H - T - B) * (1.0 - (v - ymin) / (ymax - ymin)); };
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(2);
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" font-family=\"sans-serif\" "
    << "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">" << title << "</text>\n";
  o << "<line x1=\"" << L << "\" y1=\"" << H - B << "\" x2=\"" << W - R << "\" y2=\"" << H - B << "\" stroke=\"black\"/>\n";
  o << "<line x1=\"" << L << "\" y1=\"" << T << "\" x2=\"" << L << "\" y2=\"" << H - B << "\" stroke=\"black\"/>\n";
  for (int i = 0; i <= 5; ++i) {
    const double v = ymin + (ymax - ymin) * i / 5.0, s = xmax * i / 5.0;
    o << "<text x=\"" << L - 6 << "\" y=\"" << Y(v) + 4 << "\" text-anchor=\"end\">" << v << "</text>\n";
    o << "<line x1=\"" << L << "\" y1=\"" << Y(v) << "\" x2=\"" << W - R << "\" y2=\"" << Y(v)
      << "\" stroke=\"#ddd\"/>\n";
    o << "<text x=\"" << X(s) << "\" y=\"" << H - B + 18 << "\" text-anchor=\"middle\">" << static_cast<int64_t>(s)
      << "</text>\n";
  }
  o << "<text x=\"" << W / 2 << "\" y=\"" << H - 10 << "\" text-anchor=\"middle\">step</text>\n";
  o << "<text x=\"16\" y=\"" << H / 2 << "\" transform=\"rotate(-90 16 " << H / 2
    << ")\" text-anchor=\"middle\">loss (nats/byte)</text>\n";
  o << "<line x1=\"" << L << "\" y1=\"" << Y(baseline) << "\" x2=\"" << W - R << "\" y2=\"" << Y(baseline)
    << "\" stroke=\"#c33\" stroke-dasharray=\"6 4\"/>\n";
  o << "<text x=\"" << W - R - 4 << "\" y=\"" << Y(baseline) - 6 << "\" text-anchor=\"end\" fill=\"#c33\">unigram "
    << "baseline " << baseline << "</text>\n";
  double legend_y = T + 14;
  for (const Curve& c : curves) {
    o << "<polyline fill=\"none\" stroke=\"" << c.color << "\" stroke-width=\"1.6\""
      << (c.dashed ? " stroke-dasharray=\"5 3\"" : "") << " points=\"";
    for (size_t i = 0; i < c.steps.size() && i < c.values.size(); ++i)
      if (std::isfinite(c.values[i])) o << X(static_cast<double>(c.steps[i])) << "," << Y(c.values[i]) << " ";
    o << "\"/>\n";
    if (curves.size() > 1) {
      o << "<line x1=\"" << W - R - 150 << "\" y1=\"" << legend_y << "\" x2=\"" << W - R - 126 << "\" y2=\"" << legend_y
        << "\" stroke=\"" << c.color << "\" stroke-width=\"2\"" << (c.dashed ? " stroke-dasharray=\"5 3\"" : "")
        << "/>\n<text x=\"" << W - R - 120 << "\" y=\"" << legend_y + 4 << "\">" << c.label << "</text>\n";
      legend_y += 16;
    }
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace dmuon::cli
