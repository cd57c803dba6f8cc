// host_sync.h -- counting the device-to-host reads dmuon makes.
//
// On CUDA every read of a tensor's value on the host (`.item()`, `.cpu()`) waits for the device: a
// host synchronisation. dmuon's backward and step() make a fixed number of them per step (the
// has-gradient flags of all parameters in one read, the finiteness check of all Muon gradients in
// one read), never one per parameter. Every such read goes through detail::read_to_host, which
// counts it, so tests (and users chasing stalls) can check the number per step.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace dmuon {

// Device-to-host reads dmuon made so far on the calling thread (step() makes them on the thread
// that calls it).
int64_t host_sync_count();

// Waits until `device`'s current stream has run everything queued on it (CUDA); nothing on the CPU.
// For timing (benchmarks, calibration): not counted as a host read.
void wait_for_device(const at::Device& device);

namespace detail {
// `t` copied to the host (a host synchronisation on CUDA; a plain copy on the CPU), counted.
at::Tensor read_to_host(const at::Tensor& t);
}  // namespace detail

}  // namespace dmuon
