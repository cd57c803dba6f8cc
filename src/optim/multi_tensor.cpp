// Multi-tensor element-wise work of Muon::step (multi_tensor.h).
#include "optim/multi_tensor.h"

#include <c10/util/Exception.h>

#include "dmuon/torch_version.h"

#if DMUON_TORCH_AT_LEAST(2, 0)
#include <ATen/ops/_fused_adamw.h>
#endif

namespace dmuon::detail {

bool fused_adamw_available(c10::DeviceType device) {
  if (device == c10::DeviceType::CUDA) return DMUON_TORCH_AT_LEAST(2, 0);
  if (device == c10::DeviceType::CPU) return DMUON_TORCH_AT_LEAST(2, 4);  // torch 2.4 added the CPU kernel
  return false;
}

bool fused_adamw_takes(const AdamwOperands& ops) {
  const at::Tensor& p = ops.target;
  if (!fused_adamw_available(p.device().type()) || !at::isFloatingType(p.scalar_type()) || !p.is_contiguous())
    return false;
  for (const at::Tensor* t : {&ops.grad, &ops.exp_avg, &ops.exp_avg_sq})
    if (t->scalar_type() != p.scalar_type() || t->device() != p.device() || !t->is_contiguous() ||
        t->sizes() != p.sizes())
      return false;
  return true;
}

void fused_adamw(const std::vector<AdamwOperands>& ops, const AdamwHyper& h) {
  if (ops.empty()) return;
#if DMUON_TORCH_AT_LEAST(2, 0)
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
  params.reserve(ops.size());
  // The kernel reads each step from a float32 tensor on the parameters' device (exact to 2^24 steps):
  // one copy for all, from pinned memory on CUDA so it is asynchronous (the caching host allocator
  // keeps the buffer until the copy is done): no host synchronisation in step().
  const at::Device device = ops[0].target.device();
  at::Tensor host_steps = at::empty({static_cast<int64_t>(ops.size())},
                                    at::TensorOptions().dtype(at::kFloat).pinned_memory(device.is_cuda()));
  float* s = host_steps.data_ptr<float>();
  for (size_t i = 0; i < ops.size(); ++i) {
    const AdamwOperands& o = ops[i];
    TORCH_INTERNAL_ASSERT(fused_adamw_takes(o) && o.target.device() == ops[0].target.device() &&
                          o.target.scalar_type() == ops[0].target.scalar_type());
    params.push_back(o.target);
    grads.push_back(o.grad);
    exp_avgs.push_back(o.exp_avg);
    exp_avg_sqs.push_back(o.exp_avg_sq);
    s[i] = static_cast<float>(o.step);
  }
  const at::Tensor device_steps =
      device.is_cpu() ? host_steps : host_steps.to(at::TensorOptions().device(device), /*non_blocking=*/true);
  steps = device_steps.unbind(0);
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, h.lr, h.beta1, h.beta2,
                    h.weight_decay, h.eps, /*amsgrad=*/false, /*maximize=*/false);
#else
  (void)h;
  TORCH_INTERNAL_ASSERT(false, "fused_adamw: this LibTorch has no fused AdamW (fused_adamw_available is false)");
#endif
}

void foreach_momentum(const std::vector<at::Tensor>& bufs, const std::vector<at::Tensor>& grads, double mu) {
  if (bufs.empty()) return;
  at::_foreach_mul_(bufs, mu);
  at::_foreach_add_(bufs, grads);
}

void foreach_scale_add(const std::vector<at::Tensor>& targets, const std::vector<double>& decays,
                       const std::vector<at::Tensor>& updates, const std::vector<double>& alphas) {
  if (targets.empty()) return;
  const std::vector<at::Scalar> d(decays.begin(), decays.end()), a(alphas.begin(), alphas.end());
  at::_foreach_mul_(targets, d);
  at::_foreach_mul_(updates, a);
  at::_foreach_add_(targets, updates);
}

}  // namespace dmuon::detail
