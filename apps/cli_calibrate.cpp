// cli_calibrate.cpp -- the LibTorch side of `dmuon plan --calibrate` (plan_cmd.cpp writes the file).
#include <ATen/Parallel.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <stdexcept>

#include "cli_commands.h"
#include "dmuon/tools/ns_calibration.h"

namespace dmuon::cli {

CalibrationResult calibrate_device(const CalibrationRequest& req, std::ostream& log) {
  const at::Device device(req.device);
  if (device.is_cuda() && !at::hasCUDA())
    throw std::invalid_argument("--calibrate --device " + req.device + ": this build or machine has no CUDA device");
  if (device.is_cuda() && device.has_index() && device.index() >= at::detail::getCUDAHooks().getNumGPUs())
    throw std::invalid_argument("--calibrate --device " + req.device + ": this machine has " +
                                std::to_string(at::detail::getCUDAHooks().getNumGPUs()) + " CUDA device(s)");
  if (req.threads > 0) at::set_num_threads(req.threads);
  NsCalibrationOptions o;
  o.device = device;
  o.reps = req.reps;
  o.batch = req.batch;
  o.ns_steps = req.ns_steps;
  std::vector<NsShape> shapes;
  for (const auto& s : req.shapes) shapes.push_back(NsShape{s[0], s[1], s[2]});
  log << "calibrating " << device.str() << " (" << at::get_num_threads() << " threads): matmul rate, memory bandwidth, NS of "
      << shapes.size() << " Muon targets' shapes\n";
  log.flush();
  CalibrationResult r;
  const DeviceRates rates = measure_device_rates(device, req.reps);
  r.matmul_tflops = rates.matmul_tflops;
  r.memory_bandwidth_GBps = rates.memory_bandwidth_GBps;
  r.describe = rates.describe + ", " + std::to_string(at::get_num_threads()) + " threads";
  r.profile = measure_ns_profile(shapes, o);
  return r;
}

}  // namespace dmuon::cli
