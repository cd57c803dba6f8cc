"""Loss scaling (fp16 training) for dmuon.Muon: torch.amp.GradScaler with the gradients dmuon holds."""

import torch


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` (same arguments, same methods: ``scale``, ``unscale_``, ``step``, ``update``,
    ``state_dict``) that also handles :class:`dmuon.Muon`, as FSDP's ``ShardedGradScaler`` does for sharded
    gradients. For a Muon optimizer it unscales every gradient the step uses -- the reduced sums dmuon holds
    outside ``.grad`` (a dedicated matrix's on its owner only), the replicated and ``sharded_adamw``
    gradients and FSDP2's shards -- and agrees over the model's mesh whether any holds an inf or NaN, so
    every rank skips the same steps and backs the scale off alike. Other optimizers are handled as by
    ``torch.amp.GradScaler``. ``unscale_`` and ``step`` on a Muon optimizer are collective: every rank of
    the model's mesh.

    ``torch.amp.GradScaler`` itself cannot drive :class:`dmuon.Muon`: its ``step`` raises, naming this class."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        from ._runtime import Muon

        if not isinstance(optimizer, Muon):
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        return {found_inf.device: optimizer._unscale_grads(inv_scale, found_inf, allow_fp16)}
