"""A trainable Qwen3.5-architecture target with its MTP layer, saved as a Hugging Face folder.

The target is transformers' own ``Qwen3_5ForCausalLM`` (model_type ``qwen3_5_text``: Gated
DeltaNet and gated full-attention layers, three GDN layers to one attention layer as Qwen3.5 /
3.6 interleave them); the MTP layer is the published checkpoints' (``mtp.*``, as SGLang's
``qwen3_5_mtp`` reads it and ``simtree.checkpoints.qwen3_5`` maps it): row q reads the token
x_{q+1} and the target's final-normed hidden state at q,
``fc([pre_fc_norm_embedding(embed(x_{q+1})); pre_fc_norm_hidden(h_q)])``, one full-attention
decoder layer (causal over the rows), ``norm``, the shared LM head -> x_{q+2}.

    model = TargetWithMTP(hf_config("cpu", vocab_size=2048))
    loss, parts = model.loss(ids)          # next token + MTP_WEIGHT x next-next token (MTP)
    save_folder(model, "out/qwen3.5-tiny")  # config.json + model.safetensors (HF layout + mtp.*)
    model = load_folder("out/qwen3.5-tiny")

The folder loads in ``simtree.checkpoints`` / ``simtree run --model`` (MTP weights included) and
in ``transformers.Qwen3_5ForCausalLM.from_pretrained`` (which skips ``mtp.*``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from simtree.errors import SimtreeError
from simtree.fileio import write_atomic, write_text_atomic

__all__ = ["PRESETS", "hf_config", "TargetWithMTP", "save_folder", "load_folder", "MTP_WEIGHT"]

MTP_WEIGHT = 0.3   # the MTP loss's weight beside the next-token loss (DeepSeek-V3's lambda)

# sizes per preset; every one keeps Qwen3.5's 3:1 GDN:attention interleave (full_attention_interval 4)
PRESETS = {
    "test": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                 linear_key_head_dim=16, linear_value_head_dim=16),
    "cpu": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=32, linear_value_head_dim=32),
    "gpu": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
                num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                linear_key_head_dim=64, linear_value_head_dim=64),
}


def hf_config(preset: str, vocab_size: int, max_positions: int = 4096):
    """A ``Qwen3_5TextConfig`` of the preset's sizes (head dims: powers of two >= 16, the GPU
    tree-attention kernel's; a quarter of each attention head rotated, as Qwen3.5)."""
    from transformers import Qwen3_5TextConfig

    if preset not in PRESETS:
        raise SimtreeError(f"unknown model size {preset!r}: expected one of {', '.join(PRESETS)}")
    kw = dict(PRESETS[preset])
    n = kw["num_hidden_layers"]
    rot = int(kw["head_dim"] * 0.25) // 2
    section = [rot - 2 * (rot // 3), rot // 3, rot // 3]
    return Qwen3_5TextConfig(
        vocab_size=int(vocab_size), max_position_embeddings=max_positions, tie_word_embeddings=True,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        rms_norm_eps=1e-6, mtp_num_hidden_layers=1, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": section, "mrope_interleaved": True}, **kw)


class _MTP(nn.Module):
    """The MTP layer's modules under the checkpoint's names (``mtp.fc``, ``mtp.layers.0.*``, ...)."""

    def __init__(self, config):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=eps)
        attn_idx = config.layer_types.index("full_attention")
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, attn_idx)])
        self.norm = Qwen3_5RMSNorm(h, eps=eps)


class TargetWithMTP(nn.Module):
    def __init__(self, config):
        from transformers import Qwen3_5ForCausalLM

        super().__init__()
        if "full_attention" not in config.layer_types:
            raise SimtreeError("the MTP layer is a full-attention layer: the config needs one")
        self.config = config
        self.lm = Qwen3_5ForCausalLM(config)
        self.mtp = _MTP(config)
        self.mtp.apply(self.lm._init_weights)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's final-normed hidden states [B, T, h] of ids [B, T]."""
        return self.lm.model(input_ids=ids, use_cache=False).last_hidden_state

    def mtp_hidden(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """MTP rows over next_ids [B, Q] (x_{q+1}) and hidden [B, Q, h] (h_q) -> normed [B, Q, h]."""
        m = self.mtp
        e = m.pre_fc_norm_embedding(self.lm.model.embed_tokens(next_ids))
        x = m.fc(torch.cat([e, m.pre_fc_norm_hidden(hidden)], -1))
        pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        x = m.layers[0](x, position_embeddings=self.lm.model.rotary_emb(x, pos), attention_mask=None,
                        position_ids=pos)
        return m.norm(x)

    def loss(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """ids [B, T + 1]: (next-token CE + MTP_WEIGHT x MTP CE, {"lm": float, "mtp": float})."""
        h = self.hidden(ids[:, :-1])
        lm = F.cross_entropy(self.lm.lm_head(h).flatten(0, 1).float(), ids[:, 1:].flatten())
        mh = self.mtp_hidden(ids[:, 1:-1], h[:, :-1])
        mtp = F.cross_entropy(self.lm.lm_head(mh).flatten(0, 1).float(), ids[:, 2:].flatten())
        return lm + MTP_WEIGHT * mtp, {"lm": float(lm.detach()), "mtp": float(mtp.detach())}

    def checkpoint_tensors(self, dtype=None) -> dict[str, torch.Tensor]:
        """{checkpoint key: tensor}: transformers' keys (``lm_head`` left out when tied) + ``mtp.*``."""
        out = {k: v for k, v in self.lm.state_dict().items()
               if not (k == "lm_head.weight" and self.config.tie_word_embeddings)}
        out.update({f"mtp.{k}": v for k, v in self.mtp.state_dict().items()})
        return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
                for k, v in out.items()}


def save_folder(model: TargetWithMTP, folder, dtype=torch.float32, extra_files: dict | None = None) -> Path:
    """``folder/config.json`` + ``folder/model.safetensors`` (weights first, each atomic);
    ``extra_files`` {name: text} beside them."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg.update({"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
                "dtype": str(dtype).removeprefix("torch.")})
    tensors = model.checkpoint_tensors(dtype)
    write_atomic(folder / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    write_text_atomic(folder / "config.json", json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    for name, text in (extra_files or {}).items():
        write_text_atomic(folder / name, text)
    return folder


def load_folder(folder) -> TargetWithMTP:
    """A folder written by :func:`save_folder` as a trainable model (float32)."""
    from safetensors.torch import load_file
    from transformers import Qwen3_5TextConfig

    folder = Path(folder)
    try:
        config = Qwen3_5TextConfig.from_pretrained(folder)
        tensors = load_file(folder / "model.safetensors")
    except (OSError, ValueError) as exc:
        raise SimtreeError(f"{folder}: not a readable qwen3_5_text folder ({' '.join(str(exc).split())[:120]})") from None
    model = TargetWithMTP(config)
    lm = {k: v.float() for k, v in tensors.items() if not k.startswith("mtp.")}
    missing, unexpected = model.lm.load_state_dict(lm, strict=False)
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise SimtreeError(f"{folder}: weights do not match its config (missing {missing[:2]}, "
                           f"unexpected {unexpected[:2]})")
    model.mtp.load_state_dict({k[4:]: v.float() for k, v in tensors.items() if k.startswith("mtp.")})
    model.lm.tie_weights()
    return model
