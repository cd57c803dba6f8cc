#include "cli_launch.h"

#include "dmuon/files.h"

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>
#include <vector>

namespace dmuon::cli {

namespace {
int bind_port(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("socket(): ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int got = ntohs(addr.sin_port);
  ::close(fd);
  return got;
}

std::string signal_name(int sig) {
  switch (sig) {
    case SIGKILL: return "SIGKILL";
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGSEGV: return "SIGSEGV";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    case SIGHUP: return "SIGHUP";
    case SIGSTOP: return "SIGSTOP";
    case SIGTSTP: return "SIGTSTP";
    case SIGTTIN: return "SIGTTIN";
    case SIGTTOU: return "SIGTTOU";
    default: return "signal " + std::to_string(sig);
  }
}

// Relays the children's stderr: complete lines, each written whole. A rank's error lines (those
// starting with "error") are held until the end and then shown first-failure-first: errors of
// ranks whose message is not a consequence of another rank's death (a lost peer, a failed
// collective) first, in the order their ranks exited, then the consequential ones.
class StderrRelay {
 public:
  explicit StderrRelay(std::ostream& err) : err_(err) {}
  ~StderrRelay() { close_all(); }
  void add(int rank, int fd) { chans_.push_back(Chan{rank, fd, "", {}, -1, "", false, 0}); }
  void close_all() {
    for (auto& c : chans_)
      if (c.fd >= 0) {
        ::close(c.fd);
        c.fd = -1;
      }
  }
  // A rank ended; `failure` says how when it failed ("exited with status 1"), "" when it succeeded.
  // A rank was stopped by `sig` (SIGSTOP, SIGTSTP, ...; 0: it was continued): while stopped it is
  // the likely cause of the others' timeouts.
  void stopped(int rank, int sig) {
    for (auto& c : chans_)
      if (c.rank == rank) c.stopped_by = sig;
  }
  void exited(int rank, const std::string& failure, bool signaled = false) {
    for (auto& c : chans_)
      if (c.rank == rank && !failure.empty()) {
        c.exit_order = next_exit_++;
        c.failure = failure;
        c.signaled = signaled;
      }
  }
  // Waits up to `ms` for output and relays it.
  void pump(int ms) {
    std::vector<pollfd> pfds;
    for (auto& c : chans_)
      if (c.fd >= 0) pfds.push_back(pollfd{c.fd, POLLIN, 0});
    if (pfds.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      return;
    }
    if (::poll(pfds.data(), pfds.size(), ms) <= 0) return;
    for (const auto& p : pfds)
      if (p.revents & (POLLIN | POLLHUP | POLLERR))
        for (auto& c : chans_)
          if (c.fd == p.fd) read_from(c);
  }
  // Children are gone: drain the pipes, show the held errors, then the summary.
  void finish() {
    for (auto& c : chans_)
      while (c.fd >= 0) read_from(c);
    for (auto& c : chans_)
      if (!c.partial.empty()) line(c, c.partial);
    std::vector<const Chan*> order;
    for (const auto& c : chans_)
      if (!c.errors.empty()) order.push_back(&c);
    auto consequential = [](const Chan* c) {
      for (const auto& l : c->errors)
        if (l.find("collective failed") != std::string::npos || l.find("Connection closed") != std::string::npos ||
            l.find("Connection reset") != std::string::npos || l.find("peer") != std::string::npos)
          return true;
      return false;
    };
    std::stable_sort(order.begin(), order.end(), [&](const Chan* a, const Chan* b) {
      const bool ca = consequential(a), cb = consequential(b);
      if (ca != cb) return !ca;
      const int ea = a->exit_order < 0 ? INT32_MAX : a->exit_order, eb = b->exit_order < 0 ? INT32_MAX : b->exit_order;
      return ea < eb;
    });
    std::string all;
    for (const Chan* c : order)
      for (const auto& l : c->errors) all += l + "\n";
    // the summary names the first failure: a rank killed by a signal we did not send (it could say
    // nothing; the others' errors are the consequence), else the rank whose error comes first in
    // that order (it may have been stopped by us while it was exiting), else the first rank seen failing
    const Chan* first = nullptr;
    for (const auto& c : chans_)
      if (c.signaled && (!first || c.exit_order < first->exit_order)) first = &c;
    for (const auto& c : chans_)
      if (!first && c.stopped_by != 0) {
        all += "error: rank " + std::to_string(c.rank) + " was stopped (" + signal_name(c.stopped_by) +
               ") and answered no one; stopped the other ranks\n";
        err_ << all << std::flush;
        return;
      }
    if (!first && !order.empty()) first = order.front();
    if (!first)
      for (const auto& c : chans_)
        if (!c.failure.empty() && (!first || c.exit_order < first->exit_order)) first = &c;
    if (first)
      all += "error: rank " + std::to_string(first->rank) + " failed" +
             (first->failure.empty() ? std::string() : " (" + first->failure + ")") + "; stopped the other ranks\n";
    err_ << all << std::flush;
  }

 private:
  struct Chan {
    int rank;
    int fd;
    std::string partial;
    std::vector<std::string> errors;
    int exit_order;
    std::string failure;
    bool signaled;  // killed by a signal the launcher did not send
    int stopped_by;  // the signal that stopped it while the run failed (0: not stopped)
  };
  void read_from(Chan& c) {
    char buf[4096];
    const ssize_t n = ::read(c.fd, buf, sizeof(buf));
    if (n <= 0) {
      if (n < 0 && errno == EINTR) return;
      ::close(c.fd);
      c.fd = -1;
      return;
    }
    c.partial.append(buf, static_cast<size_t>(n));
    for (size_t nl; (nl = c.partial.find('\n')) != std::string::npos;) {
      line(c, c.partial.substr(0, nl));
      c.partial.erase(0, nl + 1);
    }
  }
  void line(Chan& c, const std::string& l) {
    if (!c.errors.empty() || l.rfind("error", 0) == 0) {  // an error and its continuation lines
      c.errors.push_back(l);
      return;
    }
    err_ << l << "\n" << std::flush;  // one line at a time: never interleaved with another rank's
  }
  std::ostream& err_;
  std::vector<Chan> chans_;
  int next_exit_ = 0;
};

std::atomic<int> g_signal{0};
void on_signal(int sig) { g_signal = sig; }
}  // namespace

int pick_free_port() {
  const int p = bind_port(0);
  if (p <= 0) throw std::runtime_error("could not find a free TCP port on 127.0.0.1");
  return p;
}

bool port_available(int port) { return bind_port(port) == port; }

bool launched_as_rank() { return std::getenv("RANK") != nullptr && std::getenv("WORLD_SIZE") != nullptr; }

int launch_local_ranks(const LaunchOptions& opts, std::ostream& err) {
  int port = opts.port;
  if (port == 0) {
    port = pick_free_port();
  } else if (!port_available(port)) {
    err << "error: port " << port << " on 127.0.0.1 is in use; pick another with --port, or leave --port unset to "
           "use a free one\n";
    return 2;
  }
  const pid_t parent = ::getpid();
  std::vector<pid_t> kids;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  struct sigaction old_int {}, old_term {};
  ::sigaction(SIGINT, &sa, &old_int);
  ::sigaction(SIGTERM, &sa, &old_term);
  g_signal = 0;

  // Every child's stderr comes through a pipe, so the parent shows each line whole and the first
  // failure first (StderrRelay); stdout (rank 0's progress bar) is inherited.
  StderrRelay relay(err);
  for (int r = 0; r < opts.ranks; ++r) {
    int fds[2];
    if (::pipe(fds) != 0) {
      err << "error: pipe failed: " << std::strerror(errno) << "\n";
      for (pid_t k : kids) ::kill(k, SIGKILL);
      return 1;
    }
    const pid_t pid = ::fork();
    if (pid < 0) {
      err << "error: fork failed: " << std::strerror(errno) << "\n";
      for (pid_t k : kids) ::kill(k, SIGKILL);
      return 1;
    }
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the parent
      if (::getppid() != parent) ::_exit(1);
      ::dup2(fds[1], STDERR_FILENO);
      ::close(fds[0]);
      ::close(fds[1]);
      relay.close_all();  // the read ends of earlier ranks' pipes
      ::signal(SIGINT, SIG_IGN);  // the parent decides; a terminal ^C reaches the whole group
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(opts.ranks).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(opts.ranks).c_str(), 1);  // all on this host (as torchrun says)
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      // Like torchrun: do not let N ranks oversubscribe the cores with their own thread pools.
      const long cores = std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
      const std::string threads = std::to_string(std::max(1L, cores / opts.ranks));
      ::setenv("OMP_NUM_THREADS", threads.c_str(), 0);
      ::setenv("OPENBLAS_NUM_THREADS", threads.c_str(), 0);
      std::vector<std::string> args{"dmuon", opts.subcommand};
      args.insert(args.end(), opts.args.begin(), opts.args.end());
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv("/proc/self/exe", argv.data());
      std::fprintf(stderr, "error: exec of /proc/self/exe failed: %s\n", std::strerror(errno));
      ::_exit(127);
    }
    ::close(fds[1]);
    relay.add(r, fds[0]);
    kids.push_back(pid);
  }

  int status_out = 0;
  int remaining = static_cast<int>(kids.size());
  std::vector<bool> done(kids.size(), false);
  bool stopping = false, sent_kill = false;
  auto stop_all = [&](int sig) {
    sent_kill = sent_kill || sig == SIGKILL;
    for (size_t i = 0; i < kids.size(); ++i)
      if (!done[i]) {
        ::kill(kids[i], sig);
        ::kill(kids[i], SIGCONT);  // a stopped rank (SIGSTOP, ^Z) takes the signal now, not when continued
      }
  };
  auto stop_deadline = std::chrono::steady_clock::now();
  while (remaining > 0) {
    int st = 0;
    const pid_t pid = ::waitpid(-1, &st, WNOHANG | WUNTRACED | WCONTINUED);
    if (pid > 0 && (WIFSTOPPED(st) || WIFCONTINUED(st))) {  // a stopped rank answers nobody: remember which
      for (size_t i = 0; i < kids.size(); ++i)
        if (kids[i] == pid && !stopping) relay.stopped(static_cast<int>(i), WIFSTOPPED(st) ? WSTOPSIG(st) : 0);
      continue;
    }
    if (pid > 0) {
      for (size_t i = 0; i < kids.size(); ++i) {
        if (kids[i] != pid || done[i]) continue;
        done[i] = true;
        --remaining;
        const bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
        // ranks the launcher stopped (SIGTERM, then SIGKILL, after the first failure) are not failures;
        // a rank killed by another signal (SIGKILL before ours, SIGSEGV, ...) is the cause
        const int sig = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
        const bool stopped_by_us = stopping && (sig == SIGTERM || (sig == SIGKILL && sent_kill));
        if (!ok && !stopped_by_us)
          relay.exited(static_cast<int>(i),
                       sig ? "was killed by signal " + std::to_string(sig) + " (" + signal_name(sig) + ")"
                           : "exited with status " + std::to_string(WEXITSTATUS(st)),
                       sig != 0);
        if (!ok && !stopping) {
          status_out = WIFEXITED(st) ? WEXITSTATUS(st) : 1;
          if (status_out == 0) status_out = 1;
          stopping = true;
          stop_all(SIGTERM);
          stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        }
      }
      continue;
    }
    if (g_signal != 0 && !stopping) {
      err << "\ninterrupted (" << signal_name(g_signal.load()) << "): stopping " << remaining << " rank(s)\n";
      stopping = true;
      status_out = 128 + g_signal.load();  // the shell's convention: 130 for SIGINT, 143 for SIGTERM
      stop_all(SIGTERM);
      stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    }
    if (stopping && std::chrono::steady_clock::now() > stop_deadline) stop_all(SIGKILL);
    relay.pump(20);
  }
  relay.finish();
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  return status_out;
}

std::optional<int> parse_args(CLI::App& app, std::vector<std::string> args, std::ostream& out, std::ostream& err) {
  // "--steps -5": a negative number after an option is its value, not a flag (CLI11 would report a
  // missing argument); joined as "--steps=-5" so the option's own check names the bad value.
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    const std::string& v = args[i + 1];
    if (args[i].rfind("--", 0) == 0 && args[i].find('=') == std::string::npos && v.size() > 1 && v[0] == '-' &&
        (std::isdigit(static_cast<unsigned char>(v[1])) || v[1] == '.')) {
      args[i] += "=" + v;
      args.erase(args.begin() + static_cast<std::ptrdiff_t>(i) + 1);
    }
  }
  try {
    std::reverse(args.begin(), args.end());  // CLI11 takes the arguments last-first
    app.parse(args);
  } catch (const CLI::CallForHelp&) {
    out << app.help();
    return 0;
  } catch (const CLI::ParseError& e) {
    err << "error: " << e.what() << "\n";
    return 2;
  }
  return std::nullopt;
}

std::string error_text(const std::exception& e) {
  const auto* ce = dynamic_cast<const c10::Error*>(&e);
  std::string msg = ce ? ce->what_without_backtrace() : e.what();
  if (const auto cut = msg.find("\nException raised from"); cut != std::string::npos) msg = msg.substr(0, cut);
  return msg;
}

void write_file_atomic(const std::string& path, const std::string& content) {
  write_file_atomically(path, content, "writing " + path);
}

void leave_together(Communicator& group, const StorePtr& store, const std::string& who, double timeout_s) {
  if (group.size() == 1) return;
  group.barrier(who + ": every rank finished its collectives");
  const std::string key = "dmuon/" + who + "/finished";
  store->add(key, 1);
  if (group.rank() != 0) return;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (store->add(key, 0) < group.size()) {
    TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "rank 0: ", who, ": not every rank finished within ",
                timeout_s, " s after the run");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace dmuon::cli
