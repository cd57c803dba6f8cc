// The LibTorch-free core of dmuon's atomic file writes (atomic_write.h) and dmuon/files.h.
#include "env/atomic_write.h"

#include "dmuon/files.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <tuple>

namespace dmuon::detail {

int write_all(int fd, const void* data, size_t n, uint64_t offset) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return errno;
    if (w == 0) return EIO;
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return 0;
}

Fd::~Fd() {
  if (fd >= 0) ::close(fd);
}

namespace {
void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;  // a directory that cannot be opened: the rename is still atomic
  ::fsync(fd);
  ::close(fd);
}
// Removes the temporary files earlier writes of `target` left behind when their process died
// mid-write (kill -9, a crash, SIGTERM): ".NAME.tmp-PID" beside it whose PID no longer runs. Those of
// live processes (another writer right now) are left alone.
void remove_stale_temps(const std::filesystem::path& dir, const std::string& prefix) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string digits = name.substr(prefix.size());
    if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 9) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    if (pid == ::getpid() || pid <= 0) continue;
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to judge)
    std::error_code rm;
    fs::remove(it->path(), rm);
  }
}
// SIGINT/SIGTERM during a write: the temporary file is removed, then the signal takes its course (the
// previous disposition, re-raised). One write at a time is covered (a second concurrent one leaves its
// temporary to the next save's stale-file sweep); signals the process ignores are left alone.
std::atomic<bool> g_temp_busy{false};
char g_temp_path[4096];
struct sigaction g_old_int, g_old_term;
extern "C" void remove_temp_on_signal(int sig) {
  ::unlink(g_temp_path);  // async-signal-safe
  ::sigaction(sig, sig == SIGINT ? &g_old_int : &g_old_term, nullptr);
  ::raise(sig);
}
class TempOnSignal {
 public:
  explicit TempOnSignal(const std::string& path) {
    bool idle = false;
    if (path.size() >= sizeof g_temp_path || !g_temp_busy.compare_exchange_strong(idle, true)) return;
    mine_ = true;
    std::memcpy(g_temp_path, path.c_str(), path.size() + 1);
    struct sigaction sa {};
    sa.sa_handler = remove_temp_on_signal;
    sigemptyset(&sa.sa_mask);
    for (auto [sig, old, on] : {std::tuple{SIGINT, &g_old_int, &int_}, std::tuple{SIGTERM, &g_old_term, &term_}}) {
      ::sigaction(sig, nullptr, old);
      if (old->sa_handler == SIG_IGN) continue;
      ::sigaction(sig, &sa, nullptr);
      *on = true;
    }
  }
  ~TempOnSignal() {
    if (!mine_) return;
    if (int_) ::sigaction(SIGINT, &g_old_int, nullptr);
    if (term_) ::sigaction(SIGTERM, &g_old_term, nullptr);
    g_temp_busy = false;
  }
  TempOnSignal(const TempOnSignal&) = delete;
  TempOnSignal& operator=(const TempOnSignal&) = delete;

 private:
  bool mine_ = false, int_ = false, term_ = false;
};
// ".NAME.tmp-" of the temporary files beside `target` (built so: GCC 12 misreads "." + s as overlapping)
std::string temp_prefix(const std::filesystem::path& target) {
  std::string prefix = target.filename().string();
  prefix.insert(0, 1, '.');
  prefix.append(".tmp-");
  return prefix;
}
}  // namespace

void write_atomically(const std::string& path, const std::function<void(int fd)>& body) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  if (!fs::is_directory(dir)) throw std::runtime_error("the directory " + dir.string() + " does not exist; create it first");
  const std::string prefix = temp_prefix(target);
  remove_stale_temps(dir, prefix);
  const std::string tmp_name = prefix + std::to_string(::getpid());
  const fs::path tmp = dir / tmp_name;
  const TempOnSignal on_signal(tmp.string());
  try {
    {
      Fd f;
      // a new file of our own: never through a link someone put at the temporary's name (O_EXCL refuses
      // whatever is there, O_NOFOLLOW a final symlink); a leftover is unlinked (not followed) and made anew
      const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
      f.fd = ::open(tmp.c_str(), flags, 0644);
      if (f.fd < 0 && errno == EEXIST && ::unlink(tmp.c_str()) == 0) f.fd = ::open(tmp.c_str(), flags, 0644);
      if (f.fd < 0) throw std::runtime_error(std::string("cannot create it: ") + std::strerror(errno));
      body(f.fd);
      if (::fsync(f.fd) != 0) throw std::runtime_error("fsync failed (is the disk full?)");
    }
    fs::rename(tmp, target);  // atomic within one file system
    fsync_dir(dir.string());
  } catch (const std::exception&) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw;
  }
}

}  // namespace dmuon::detail

namespace dmuon {

void write_file_atomically(const std::string& path, const std::string& content, const std::string& who) {
  try {
    detail::write_atomically(path, [&](int fd) {
      if (const int e = detail::write_all(fd, content.data(), content.size(), 0); e != 0)
        throw std::runtime_error(std::strerror(e));
    });
  } catch (const std::exception& e) {
    throw std::runtime_error(who + ": writing '" + path + "' failed: " + e.what() + " (nothing was replaced).");
  }
}

void append_file_durably(const std::string& path, const std::string& content, const std::string& who) {
  auto fail = [&](const std::string& why) {
    return std::runtime_error(who + ": appending to '" + path + "' failed: " + why + ".");
  };
  detail::Fd f;
  f.fd = ::open(path.c_str(), O_WRONLY | O_NOFOLLOW | O_CLOEXEC);
  if (f.fd < 0) throw fail(std::string("cannot open it: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) throw fail(std::string("cannot read its size: ") + std::strerror(errno));
  if (const int e = detail::write_all(f.fd, content.data(), content.size(), static_cast<uint64_t>(st.st_size)); e != 0)
    throw fail(std::strerror(e));
  if (::fsync(f.fd) != 0) throw fail("fsync failed (is the disk full?)");
}

void remove_stale_temporaries(const std::string& path) {
  const std::filesystem::path target(path);
  const std::filesystem::path dir = target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  detail::remove_stale_temps(dir, detail::temp_prefix(target));
}

}  // namespace dmuon
