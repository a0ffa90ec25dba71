"""A tiny random DeepSeek-V4 checkpoint made with transformers' own classes (the parity tests'
oracle): odd sizes, every layer kind (sliding / CSA / HCA), hash and routed MoE, YaRN on the
compressed layers, tiny compression ratios so that CSA / HCA entries complete within a prompt."""
from __future__ import annotations

import torch

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention", "heavily_compressed_attention"]
MLP_TYPES = ["hash_moe", "hash_moe", "moe", "moe", "moe"]


def tiny_config(**over):
    from transformers import DeepseekV4Config
    kw = dict(vocab_size=101, hidden_size=40, moe_intermediate_size=24, num_hidden_layers=len(LAYER_TYPES),
              num_attention_heads=4, head_dim=24, q_lora_rank=20, partial_rotary_factor=8 / 24,
              num_experts_per_tok=2, n_routed_experts=6, layer_types=LAYER_TYPES, mlp_layer_types=MLP_TYPES,
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, hc_mult=3,
              hc_sinkhorn_iters=7, o_groups=2, o_lora_rank=12, index_n_heads=3, index_head_dim=16, index_topk=3,
              sliding_window=6, max_position_embeddings=4096, swiglu_limit=2.0,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                               "beta_fast": 32, "beta_slow": 1})
    kw.update(over)
    return DeepseekV4Config(**kw)


@torch.no_grad()
def tiny_model(seed: int = 0, **over):
    """A float32 DeepseekV4ForCausalLM with every parameter drawn (no zero bias, sink or table)."""
    from transformers import DeepseekV4ForCausalLM
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(tiny_config(**over)).float().eval()
    g = torch.Generator().manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "inv_freq" in name:
            continue
        if name.endswith("tid2eid"):
            E, k = model.config.n_routed_experts, t.shape[1]
            t.copy_(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t.shape[0])]))
        elif name.endswith(("norm.weight", "layernorm.weight")):
            t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
        elif t.dim() >= 2:
            t.copy_(torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5)
        else:
            t.copy_(0.5 * torch.randn(t.shape, generator=g))
    return model


def save_tiny(path, seed: int = 0, **over):
    model = tiny_model(seed, **over)
    model.save_pretrained(path)
    return model
