"""The embedded tiny default: a Qwen3.5-architecture checkpoint (``qwen3_5_text``) small enough to
ship, with an MTP layer, written as ``Qwen3_5ForCausalLM.save_pretrained`` writes it.

    python -m simtree.runtime.full.tiny --out simtree/data/models/runtime-tiny   # regenerates it

What ``simtree run`` decodes when no ``--model`` is given, through the same loading path
(``simtree.checkpoints``) and engine as a user's checkpoint.  Sizes: hidden 128, three GDN layers
and one gated-attention layer, a byte vocabulary of 260 (``simtree.runtime.tokenizer``), an
untied LM head.  The weights are random (seeded, so the command gives the same file again) and,
as :func:`simtree.runtime.full.lossless.make_predictable` makes them, nearly a bigram model of
the token: each residual branch's output projection is scaled by ``LAYER_GAIN`` and the MTP
layer's fuse projection passes the token's embedding through, so its drafts are accepted often
and rejected often.  The layers still shape every logit (the target is not a bigram table).
The LM head (shared by the MTP layer) is ``HEAD_SCALE`` times the usual scale, so the drafter's
top-1 probability is about how often its token is accepted (0.5 on ShareGPT prompts), as a
trained drafter's roughly is: best-first and EAGLE trees are shaped by meaningful scores.
Stored in bfloat16, as Qwen3.5 checkpoints are (2.4 MB); the runtime computes in float32 on a CPU.

transformers (>= 5, with Qwen3.5) writes the config and the model's weights; the MTP layer's
tensors (``mtp.*``, which transformers does not keep) are added to the same safetensors file
under the published checkpoints' names (``simtree.checkpoints.qwen3_5``).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from simtree.errors import SimtreeError
from simtree.fileio import write_atomic

__all__ = ["write_tiny_checkpoint", "TINY_CONFIG", "LAYER_GAIN", "HEAD_SCALE", "SEED"]

SEED = 0
LAYER_GAIN = 0.2
HEAD_SCALE = 4.0   # the LM head's logits this much sharper than at std fan_in^-1/2: calibrated drafts
TINY_CONFIG = dict(vocab_size=260, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                   layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                   max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   bos_token_id=256, eos_token_id=257, pad_token_id=258,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
OUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


def _random(shape, gen: torch.Generator, name: str, gain: float) -> torch.Tensor:
    """A weight at a scale that keeps activations O(1): matrices std fan_in^-1/2 (output
    projections times ``gain``), embeddings std 1, zero-centred norms 0 (scale 1), the GDN
    output norm 1, A_log log U(1, 16), dt_bias 1."""
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1, 16, generator=gen).log()
    if name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
        return torch.ones(shape)
    if len(shape) == 1:
        return torch.zeros(shape)
    if "embed" in name:
        return torch.randn(shape, generator=gen)
    fan_in = shape[-1] if "conv1d" in name else int(torch.tensor(shape[1:]).prod())
    w = torch.randn(shape, generator=gen) * fan_in ** -0.5
    if name == "lm_head.weight":
        return w * HEAD_SCALE
    return w * gain if name.endswith(OUT_PROJECTIONS) else w


def _mtp_tensors(cfg: dict, gen: torch.Generator, gain: float) -> dict:
    """The MTP layer under the published names: one gated-attention decoder layer, its norms,
    and ``fc`` over [token embedding; hidden] = [I, gain * random]."""
    from simtree.checkpoints.qwen3_5 import shape_fields
    from simtree.models import ModelShape
    from simtree.checkpoints.qwen3_5 import tensor_plan
    shape = ModelShape(**shape_fields({**cfg, "model_type": "qwen3_5_text"}, "tiny"), source="")
    keys = tensor_plan({**cfg, "model_type": "qwen3_5_text"}, shape).optional["MTP layer"]
    out = {k: _random(s, gen, k, gain) for k, s in sorted(keys.items())}
    h = cfg["hidden_size"]
    out["mtp.fc.weight"][:, :h] = torch.eye(h)
    out["mtp.fc.weight"][:, h:] *= gain
    return out


@torch.no_grad()
def write_tiny_checkpoint(out, layer_gain: float = LAYER_GAIN, seed: int = SEED, **config) -> Path:
    """Write config.json and model.safetensors of the tiny default into ``out`` (each file
    replaced atomically); the same bytes every time.  ``layer_gain`` (0: every residual branch
    silent, so the target is a bigram model of the token and the MTP layer drafts exactly its
    tokens), ``seed`` and ``config`` (Qwen3_5TextConfig fields) make other tiny models (tests)."""
    try:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    except ImportError:
        raise SimtreeError("writing the tiny checkpoint needs transformers >= 5 (Qwen3.5): "
                           "pip install 'transformers>=5'") from None
    from safetensors.torch import load_file, save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen3_5TextConfig(**{**TINY_CONFIG, **config})
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        p.copy_(_random(tuple(p.shape), gen, name, layer_gain))
    model = model.to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors = load_file(str(Path(tmp) / "model.safetensors"))
        cfg = json.loads((Path(tmp) / "config.json").read_text(encoding="utf-8"))
    tensors.update({k: v.to(torch.bfloat16) for k, v in _mtp_tensors(cfg, gen, layer_gain).items()})
    write_atomic(out / "model.safetensors",
                 lambda t: save_file(dict(sorted(tensors.items())), t, metadata={"format": "pt"}))
    cfg.pop("transformers_version", None)    # the file stays the same under another transformers
    text = json.dumps(cfg, indent=2, sort_keys=True) + "\n"
    write_atomic(out / "config.json", lambda t: Path(t).write_text(text, encoding="utf-8"))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for config.json and model.safetensors")
    args = ap.parse_args(argv)
    try:
        print(write_tiny_checkpoint(args.out))
    except SimtreeError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
