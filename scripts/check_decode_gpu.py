"""GPU check of the runtime's plain decoding step: the fused GDN decode (per-node kernel writing
the new state over the old one) against the torch step in float64, and the engine's mode none
(the shipped tiny default, float32 on CUDA) against the same on the CPU in float64.  Run from the repository root: python3 scripts/check_decode_gpu.py"""

import numpy as np
import torch

from simtree.kernels.gdn.ops import recurrent_step
from simtree.runtime.full.build import build_model
from simtree.runtime.full.generate import greedy_decode

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
rng = np.random.default_rng(1)
prompts = [rng.integers(0, 256, n).tolist() for n in (5, 9, 7)]
outs = greedy_decode(build_model("runtime-tiny", device="cuda", dtype=torch.float32), prompts, 10)
ref = greedy_decode(build_model("runtime-tiny", device="cpu", dtype=torch.float64), prompts, 10)
print("engine none on CUDA == on the CPU in float64:", outs == ref)
assert outs == ref
