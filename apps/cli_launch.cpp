#include "cli_launch.h"

#include <CLI/CLI.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>

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

  for (int r = 0; r < opts.ranks; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      err << "error: fork failed: " << std::strerror(errno) << "\n";
      for (pid_t k : kids) ::kill(k, SIGKILL);
      return 1;
    }
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the parent
      if (::getppid() != parent) ::_exit(1);
      ::signal(SIGINT, SIG_IGN);  // the parent decides; a terminal ^C reaches the whole group
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(opts.ranks).c_str(), 1);
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
    kids.push_back(pid);
  }

  int status_out = 0;
  int remaining = static_cast<int>(kids.size());
  std::vector<bool> done(kids.size(), false);
  bool stopping = false;
  auto stop_all = [&](int sig) {
    for (size_t i = 0; i < kids.size(); ++i)
      if (!done[i]) ::kill(kids[i], sig);
  };
  auto stop_deadline = std::chrono::steady_clock::now();
  while (remaining > 0) {
    int st = 0;
    const pid_t pid = ::waitpid(-1, &st, WNOHANG);
    if (pid > 0) {
      for (size_t i = 0; i < kids.size(); ++i) {
        if (kids[i] != pid || done[i]) continue;
        done[i] = true;
        --remaining;
        const bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
        if (!ok && !stopping) {
          if (WIFSIGNALED(st))
            err << "error: rank " << i << " was killed by signal " << WTERMSIG(st) << "; stopping the other ranks\n";
          else
            err << "error: rank " << i << " exited with status " << WEXITSTATUS(st)
                << "; stopping the other ranks\n";
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
      err << "\ninterrupted (signal " << g_signal.load() << "): stopping " << remaining << " rank(s)\n";
      stopping = true;
      status_out = 130;
      stop_all(SIGTERM);
      stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    }
    if (stopping && std::chrono::steady_clock::now() > stop_deadline) stop_all(SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  return status_out;
}

std::optional<int> parse_args(CLI::App& app, std::vector<std::string> args, std::ostream& out, std::ostream& err) {
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

void write_file_atomic(const std::string& path, const std::string& content) {
  const std::filesystem::path p(path);
  std::string name(1, '.');
  name += p.filename().string();
  name += ".tmp";
  name += std::to_string(::getpid());
  const std::filesystem::path tmp = p.parent_path() / name;
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw std::runtime_error("cannot write " + tmp.string());
    f << content;
    f.flush();
    if (!f) throw std::runtime_error("write failed for " + tmp.string());
  }
  std::filesystem::rename(tmp, p);
}

}  // namespace dmuon::cli
