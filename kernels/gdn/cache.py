"""What a GDN tree verify hands to the accepted-path commit."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .meta import TreeMeta


@dataclass
class GDNTreeCache:
    """u [N, HV, V] (fp32, or bf16 where the verify ran with ``u_cache_bf16``), cumulative
    log-decay G [N, HV] fp32, the round's ``TreeMeta`` and whether q/k were L2-normalised.
    ``launch``: the switches the Triton launch took where its dispatch can change what the
    rule or the caller asked for (``kside``, ``g_pass``, ``transposed`` - the Triton
    transposed walk -, ``cuda_walk``, ``walk_kside``, ``kside_cuda``, ``l2_prefetch``: what
    ran, e.g. the Triton kernels where the CUDA ones cannot; ``fold`` where a pending path or
    round was folded; ``stream`` 1 alone, with fold 5, for the K-streamed verify); empty for the
    torch backend."""
    u: torch.Tensor
    G: torch.Tensor
    meta: TreeMeta
    qk_l2norm: bool
    launch: dict = field(default_factory=dict)
