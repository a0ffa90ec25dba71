"""GPU check of the runtime's plain decoding step: the fused GDN decode (per-node kernel writing
the new state over the old one) against the torch step in float64, and the engine's mode none
against greedy decoding on CUDA.  Run from the repository root: python3 scripts/check_decode_gpu.py"""
import sys

import numpy as np
import torch

from simtree.runtime.engine import SpecEngine, greedy_decode
from simtree.kernels.gdn.ops import recurrent_step
from simtree.planning.modes import NoneParams

sys.path.insert(0, "tests")
from runtime_helpers import random_prompts, tiny_model  # noqa: E402 - the tests' tiny models

torch.manual_seed(0)
B, H, HV, K, V = 5, 16, 48, 128, 128
q, k = torch.randn(B, H, K, device="cuda").bfloat16(), torch.randn(B, H, K, device="cuda").bfloat16()
v = torch.randn(B, HV, V, device="cuda").bfloat16()
g = torch.nn.functional.logsigmoid(torch.randn(B, HV, device="cuda") + 3)
beta = torch.sigmoid(torch.randn(B, HV, device="cuda"))
S = torch.randn(B, HV, K, V, device="cuda") * 0.05
Sw = S.double().clone()
want = recurrent_step(q.double(), k.double(), v.double(), g.double(), beta.double(), Sw, backend="torch")
out = recurrent_step(q, k, v, g, beta, S)   # auto: the fused kernel on CUDA, in place
eo = float((out.double() - want).abs().max() / want.abs().max())
es = float((S.double() - Sw).abs().max() / Sw.abs().max())
print(f"fused decode vs torch step (fp64): out {eo:.2e}, state {es:.2e}")
assert eo < 2e-2 and es < 1e-4
model = tiny_model(3).float().cuda()
prompts = random_prompts(np.random.default_rng(1), [5, 9, 7])
res = SpecEngine(model, None).generate(prompts, 10, NoneParams())
ref = [greedy_decode(model, p, 10) for p in prompts]
print("engine none == greedy_decode on CUDA:", res.outputs == ref)
assert res.outputs == ref
