"""Shared builders for the runtime tests: tiny float64 models with well-separated logits."""
from __future__ import annotations

import copy

import numpy as np
import torch

from simtree.runtime.model import HybridLM, ModelConfig

torch.set_num_threads(1)  # tiny shapes: extra threads only spin on the shared CI cores

VOCAB = 64


def tiny_config(layer_types=("linear_attention", "linear_attention", "full_attention")) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, layer_types=list(layer_types),
                       linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       tie_word_embeddings=False)


def tiny_model(seed: int = 0, layer_types=None) -> HybridLM:
    """float64 random model.  Untied head and embeddings of std 0.3 so greedy decoding wanders
    over the vocabulary instead of repeating its input (a tied random model echoes it); the
    GDN gates span strong and weak decay."""
    torch.manual_seed(seed)
    model = HybridLM(tiny_config(*(() if layer_types is None else (layer_types,)))).double().eval()
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0, 0.3)
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand_like(p) * 4 + 0.05))
    return model


def perturbed(model: HybridLM, scale: float, seed: int = 1) -> HybridLM:
    """A draft model: the target with Gaussian noise on every weight (partial acceptance)."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale * p.std().clamp_min(1e-3))
    return draft


def random_prompts(rng: np.random.Generator, lengths) -> list[list[int]]:
    return [rng.integers(0, VOCAB, int(n)).tolist() for n in lengths]


def random_tree_parents(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int64)
