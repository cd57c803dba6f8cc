"""Loss scaling (fp16 training) for dmuon.Muon: torch.amp.GradScaler with the gradients dmuon holds."""

import torch
import torch.distributed as dist


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` (same arguments, same methods: ``scale``, ``unscale_``, ``step``, ``update``,
    ``state_dict``) that also handles :class:`dmuon.Muon`, as FSDP's ``ShardedGradScaler`` does for sharded
    gradients. For a Muon optimizer it unscales every gradient the step uses -- the reduced sums dmuon holds
    outside ``.grad`` (a dedicated matrix's on its owner only), the replicated and ``sharded_adamw``
    gradients and FSDP2's shards -- and agrees over the model's mesh whether any holds an inf or NaN, so
    every rank skips the same steps and backs the scale off alike. Other optimizers are handled as by
    ``torch.amp.GradScaler``; when one shares this scaler with a Muon, ``update`` also agrees their infs over
    the mesh, so the scale stays the same on every rank (dmuon's reduces add up the ranks' scaled
    gradients); one over a dedicated model's parameters (a torch optimizer after ``prepare_muon_grads``)
    agrees its infs over the model's ranks when it unscales. ``unscale_`` and ``step`` on a Muon optimizer or
    on one over a dedicated model's parameters, and ``update`` after one, are collective: every rank of the
    model's mesh.

    ``torch.amp.GradScaler`` itself cannot drive :class:`dmuon.Muon`: its ``step`` raises, naming this class."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._dmuon_groups = []  # the world groups of the Muon optimizers this scaler has served
        self._dmuon_ids = set()  # id() of the Muon optimizers checked since the last update()

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        from ._runtime import Muon, _world_groups_of

        if not isinstance(optimizer, Muon):
            # a torch optimizer over a dedicated model's parameters (after prepare_muon_grads): a dedicated
            # matrix's gradient lives on its owner alone, so the ranks agree on the infs (collective over the
            # model's ranks), or they would step and back off differently and the replicas drift apart; and on
            # torch's refusal (an fp16 gradient, on its owner only), which then raises on every rank
            params = [p for g in optimizer.param_groups for p in g["params"]]
            groups = _world_groups_of(params)
            if not groups:
                return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
            half = [p for p in params if p.dtype == torch.float16 and p.requires_grad]
            if half and not allow_fp16:
                # torch's refusal, decided from what every rank knows (the parameters' dtypes) before any gradient
                # is unscaled: a float16 matrix's gradient is on its owner alone, and the others would unscale
                # theirs before hearing of the owner's refusal
                raise ValueError(f"rank {dist.get_rank()}: GradScaler.unscale_: Attempting to unscale FP16 gradients "
                                 f"(torch's refusal): {len(half)} float16 parameter(s) of a dedicated model in this "
                                 "optimizer (after prepare_muon_grads a float16 matrix's gradient is on its owner only). "
                                 "Keep float32 master weights (param_policy's param_dtype for float16 compute) or use "
                                 "dmuon.Muon.")
            found, error = {}, None
            try:
                found = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
            except Exception as e:  # (reported to the other ranks first: none may be left in the all-reduce)
                error = e
            inf = torch.stack([found_inf.to(torch.float32).reshape(())] + [
                t.to(found_inf.device, torch.float32).reshape(()) for t in found.values()]).amax()
            agreed = torch.stack([inf, torch.tensor(float(error is not None), device=found_inf.device)])
            for group in groups:
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
            if error is not None:
                raise error
            if float(agreed[1]) > 0:
                raise ValueError(f"rank {dist.get_rank()}: GradScaler.unscale_: another rank of the model refused "
                                 "to unscale its gradients (torch's \"Attempting to unscale FP16 gradients.\": a "
                                 "float16 parameter's gradient, which after prepare_muon_grads only its owner holds). "
                                 "Keep float32 master weights (param_policy's param_dtype for float16 compute) or "
                                 "use dmuon.Muon.")
            found = dict(found) or {found_inf.device: found_inf}
            for t in found.values():
                t.copy_(agreed[0].to(t.device))
            return found
        group = optimizer._model_state.world_group
        if group is not None and dist.get_world_size(group) > 1 and all(g is not group for g in self._dmuon_groups):
            self._dmuon_groups.append(group)
        self._dmuon_ids.add(id(optimizer))
        return {found_inf.device: optimizer._unscale_grads(inv_scale, found_inf, allow_fp16)}

    def update(self, new_scale=None):
        """``torch.amp.GradScaler.update``; where an optimizer other than a dmuon.Muon shares this scaler, its
        infs are first agreed over the Muon optimizers' meshes (collective there)."""
        if self._enabled and new_scale is None and self._dmuon_groups and \
                any(key not in self._dmuon_ids for key in self._per_optimizer_states):
            infs = [t for state in self._per_optimizer_states.values() for t in state["found_inf_per_device"].values()]
            if infs:
                agreed = torch.stack([t.to(self._scale.device, torch.float32) for t in infs]).amax()
                for group in self._dmuon_groups:
                    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
                for t in infs:
                    t.copy_(agreed.to(t.device))
        self._dmuon_ids = set()
        super().update(new_scale)
