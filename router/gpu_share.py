"""GPUs by default: where the Ray cluster has GPUs and no pool asked for any, `pdserve
serve` (``--device auto``) gives each rank an equal share of them.

The router imports no torch: what the cluster holds comes from Ray
(``ray.cluster_resources()["GPU"]``), counted once at start. A rank asking for a
fraction of a GPU shares it with another rank (a prefill and a decode rank on one GPU,
each with its own memory budget); its pool then votes over gloo (rank/group_member.py:
vote_device), since NCCL refuses a group with two ranks on one GPU.
"""

from __future__ import annotations

from pdserve.router.config import RouterConfig

# Ray's resource amounts are kept to four decimal places; a share is rounded down so
# that the ranks together never ask for more than the cluster has.
_SHARE_STEP = 1e-4


def give_pools_gpus(config: RouterConfig, gpus: float) -> str | None:
    """Set the num_gpus of the pools whose engines may take a GPU (device auto or
    cuda) and asked for none: every rank the same share of ``gpus``, a whole GPU where
    there are enough. Returns what was decided (for the log), or None when nothing
    changed. ValueError when a pool forces device cuda on a cluster without GPUs."""
    pools = config.pools()
    decided = None
    taking = [p for p in pools if p.engine.device != "cpu" and p.replicas > 0]
    ranks = sum(p.replicas for p in taking)
    if gpus > 0 and ranks and not any(p.num_gpus > 0 for p in pools):  # else: placed by the user
        share = min(1.0, int(gpus / ranks / _SHARE_STEP) * _SHARE_STEP)
        for p in taking:
            p.num_gpus = share
        names = ", ".join(f"{p.replicas} {p.name}" for p in taking)
        decided = (f"{gpus:g} GPU(s) in the cluster: {names} rank(s) get {share:g} GPU each"
                   + (" (sharing a GPU: their pools vote over gloo)" if share < 1 else ""))
    for p in pools:
        if p.engine.device.startswith("cuda") and not p.num_gpus:
            raise ValueError(
                f"{p.name}.engine.device {p.engine.device}, but " + (
                    f"{p.name} num_gpus is 0: Ray shows a rank only the GPUs it asks for"
                    if gpus > 0 else "the Ray cluster has no GPU (ray.cluster_resources() "
                    "shows none)"))
    return decided
