// dmuon._C: torch.distributed groups as dmuon communicators -- their backends, the collective
// timeout dmuon applies over them, and Ctrl-C while the host waits for one of their collectives.
#include <c10/util/Exception.h>

#include <atomic>
#include <csignal>
#include <cmath>
#include <cstdlib>
#include <string>

#include "bindings.h"
#include "dmuon/env.h"

namespace dmuon::python {

namespace {

std::optional<std::chrono::milliseconds> backend_timeout(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                         const at::Device& device) {
  if (!group) return std::nullopt;
  try {
    if (auto o = group->getBackend(device.type())->getBackendOptions()) return o->timeout;
  } catch (const std::exception&) {
    // a backend without options (or none for this device): no timeout of its own
  }
  return std::nullopt;
}

// The default group (what init_process_group created), or null when torch.distributed is not initialised.
c10::intrusive_ptr<c10d::ProcessGroup> default_group() {
  try {
    py::module_ c10d = py::module_::import("torch.distributed.distributed_c10d");
    if (!c10d.attr("is_initialized")().cast<bool>()) return {};
    return c10d.attr("_get_default_group")().cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  } catch (const std::exception&) {
    return {};
  }
}

}  // namespace

std::chrono::milliseconds collective_timeout(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Device& device) {
  const std::string env = env::collective_timeout();
  if (!env.empty()) {
    char* end = nullptr;
    const double s = std::strtod(env.c_str(), &end);
    TORCH_CHECK_VALUE(end && *end == '\0' && std::isfinite(s) && s > 0 && s < 1e9, "DMUON_COLLECTIVE_TIMEOUT='", env,
                      "' is not a positive number of seconds (e.g. DMUON_COLLECTIVE_TIMEOUT=120). Unset it to use "
                      "the timeout given to init_process_group.");
    return std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(s * 1000)));
  }
  std::optional<std::chrono::milliseconds> t = backend_timeout(group, device);
  if (const auto d = backend_timeout(default_group(), device)) t = t ? std::min(*t, *d) : *d;
  return t && t->count() > 0 ? *t : kDefaultCollectiveTimeout;
}

std::pair<CommPtr, std::chrono::milliseconds> backend_of(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                         const at::Device& device) {
  if (!group) return {CommPtr(), kDefaultCollectiveTimeout};
  return {group->getBackend(device.type()), collective_timeout(group, device)};
}

std::shared_ptr<Communicator> communicator_of(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                              std::vector<int> global_ranks, const at::Device& device,
                                              const std::string& name) {
  if (!group) return nullptr;
  const auto [backend, timeout] = backend_of(group, device);
  TORCH_CHECK_VALUE(static_cast<int>(global_ranks.size()) == backend->getSize(), name, ": ", global_ranks.size(),
                    " global ranks given for a group of ", backend->getSize());
  return std::make_shared<Communicator>(backend, name, std::move(global_ranks), timeout, std::make_shared<CommCounters>(),
                                        device);
}

namespace {
// SIGINTs seen by the handler below, which then runs the handler it replaced (Python's: it sets the
// flag from which Python raises KeyboardInterrupt). Counting needs no GIL, so a wait that holds dmuon's
// locks never waits for the GIL (another Python thread may hold it and wait for those locks).
std::atomic<uint64_t> g_sigints{0};
struct sigaction g_previous {};

void on_sigint(int sig) {
  g_sigints.fetch_add(1, std::memory_order_relaxed);
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) g_previous.sa_handler(sig);
}
}  // namespace

const char* Interrupted::what() const noexcept {
  return "dmuon: interrupted by SIGINT (Ctrl-C) while waiting for a collective; the group is unusable now";
}

void install_interrupt_check() {
  // only over Python's own SIGINT handler (a plain handler function); a later signal.signal(SIGINT, ...)
  // replaces this one, and waits then block until done or the timeout, as without this check
  struct sigaction current {};
  if (sigaction(SIGINT, nullptr, &current) != 0 || (current.sa_flags & SA_SIGINFO) || current.sa_handler == SIG_DFL ||
      current.sa_handler == SIG_IGN || current.sa_handler == &on_sigint)
    return;
  g_previous = current;
  struct sigaction mine = current;
  mine.sa_handler = &on_sigint;
  if (sigaction(SIGINT, &mine, nullptr) != 0) return;
  set_wait_interrupt_check(WaitInterrupt{[] { return g_sigints.load(std::memory_order_relaxed); },
                                         [](uint64_t since) {
                                           if (g_sigints.load(std::memory_order_relaxed) != since) throw Interrupted();
                                         }});
}

}  // namespace dmuon::python
