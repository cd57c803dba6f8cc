// process_group.h -- the abstract c10d process-group types dmuon's core is written against.
//
// LibTorch 1.13: ProcessGroupGloo/NCCL derive from c10d::ProcessGroup (collectives are virtual
// there). LibTorch 2.x: they derive from c10d::Backend and c10d::ProcessGroup became a dispatcher
// front-end; calling the Backend directly has the same method names and option structs. `CommBase`
// names whichever base the concrete groups have, so the same code builds on both. Concrete groups
// (Gloo, NCCL) are created only in the separately compiled bootstrap module.
#pragma once

#include <chrono>

#include "dmuon/torch_version.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#if DMUON_TORCH_AT_LEAST(2, 0)
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#endif

namespace dmuon {

#if DMUON_TORCH_AT_LEAST(2, 0)
using CommBase = c10d::Backend;
#else
using CommBase = c10d::ProcessGroup;
#endif
using CommPtr = c10::intrusive_ptr<CommBase>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using StorePtr = c10::intrusive_ptr<c10d::Store>;

// Every dmuon collective waits at most this long unless the caller configures another timeout:
// a lost peer becomes an error, never a hang.
inline constexpr std::chrono::milliseconds kDefaultCollectiveTimeout{std::chrono::seconds(300)};

}  // namespace dmuon
