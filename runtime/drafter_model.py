"""A trainable block drafter (``block`` / ``dspark``) for a target folder, and its folder on disk.

    drafter = BlockDrafterModule(cfg, embed, lm_head)          # the runtime's weights, as parameters
    feats, greedy = target_features(target, ids, taps)         # what the runtime feeds it, and labels
    logits, conf = drafter(feats, ids, anchors, labels)        # [B, N, L, V], [B, N, L] (dspark) or None
    save_drafter(model_dir / "drafters" / "block", drafter, record)
    sizes, tensors = read_drafter(model_dir / "drafters" / "block")    # -> DrafterRound(weights=...)

The module is the runtime's block forward (``kernels.layers.drafters.backbone_forward`` then
``block_marginals`` / ``dspark_draft``) written with differentiable torch ops for many blocks at
once: every anchor ``p`` of a sequence is one block whose rows sit at positions p .. p + L - 1
(row 0 the anchor token ``ids[p]``, rows 1.. the mask token), attending to the context rows
0 .. p - 1 (the target's tapped hidden states, ``fc`` + ``hidden_norm``, read through each draft
layer's K/V projection) and to every row of their own block - the attention the runtime's round
computes from its cache and the round's new rows.  The parameters carry the runtime's names
(``drafter_specs(cfg, with_ends=False)``); the embedding and LM head are the target's, frozen.
DSpark's Markov head is teacher-forced (row j's previous token is the target's token at depth
j, the one the chain drafts whenever the rows before it were accepted) and its confidence head
reads detached inputs.

Folder layout (``MODEL/drafters/<family>/``): ``config.json`` (schema, family, the drafter's
sizes, the tapped target layers), ``model.safetensors`` (the runtime's names, float32),
``training.json`` and ``training_log.csv`` (:mod:`.drafter_train`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from simtree.drafters import DRAFTER_ROPE_THETA
from simtree.errors import SimtreeError
from simtree.fileio import write_atomic, write_text_atomic
from simtree.kernels.layers import reference as ref
from simtree.kernels.layers.drafters import DrafterConfig, drafter_specs
from simtree.kernels.layers.qwen import EPS
from simtree.kernels.layers.rope import RopeTable
from simtree.kernels.layers.weights import make_weights

__all__ = ["BlockDrafterModule", "target_features", "save_drafter", "read_drafter", "DRAFTER_SCHEMA", "SIZE_FIELDS",
           "TRAINABLE"]

DRAFTER_SCHEMA = "simtree.block_drafter/1"
SIZE_FIELDS = ("block_len", "layers", "target_layers", "markov_rank", "cand_k", "adapter_dim", "mask_token")
TRAINABLE = ("block", "dspark", "tfm")


class BlockDrafterModule(nn.Module):
    def __init__(self, cfg: DrafterConfig, embed: torch.Tensor, lm_head: torch.Tensor, seed: int = 0):
        super().__init__()
        if cfg.family not in TRAINABLE:
            raise SimtreeError(f"drafter family {cfg.family!r} is not trainable here (trainable: {', '.join(TRAINABLE)})")
        self.cfg = cfg
        init = make_weights(drafter_specs(cfg, with_ends=False), "cpu", torch.float32, seed)   # the runtime's init
        self.names = list(init)
        self.p = nn.ParameterDict({k.replace(".", "__"): nn.Parameter(v) for k, v in init.items()})
        self.register_buffer("embed", embed.detach().float(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().float(), persistent=False)
        self.rope = RopeTable(cfg.dims.rope, DRAFTER_ROPE_THETA, "cpu", 4096)

    def w(self, name: str) -> torch.Tensor:
        return self.p[name.replace(".", "__")]

    def tensors(self) -> dict[str, torch.Tensor]:
        """{runtime name: float32 tensor} (``DrafterRound(weights=...)``)."""
        return {k: self.w(k).detach().float().contiguous() for k in self.names}

    def load_backbone(self, tensors: dict[str, torch.Tensor], source) -> None:
        """The backbone's weights from a trained drafter's ``tensors`` (a tfm adapter's base), frozen."""
        names = [k for k in self.names if not k.startswith(("tfm.", "markov.", "conf."))]
        bad = [k for k in names if k not in tensors or tuple(tensors[k].shape) != tuple(self.w(k).shape)]
        if bad:
            raise SimtreeError(f"{source}: its backbone does not fit this drafter ({bad[0]!r} missing or of another "
                               "shape): train it with the same --layers and --block-len")
        with torch.no_grad():
            for k in names:
                self.w(k).copy_(tensors[k])
                self.w(k).requires_grad_(False)

    def _heads(self, x: torch.Tensor, name: str, pos: torch.Tensor, heads: int) -> torch.Tensor:
        """x [..., heads * D] -> RMSNorm(``name``) + RoPE at positions ``pos`` [...] -> [..., heads, D]."""
        D = self.cfg.dims.D
        lead = x.shape[:-1]
        y = ref.norm_rope(x.reshape(-1, heads, D), self.w(name), self.rope.rows(pos), 0, False, EPS, True)
        return y.view(*lead, heads, D)

    def forward(self, feats: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor, labels: torch.Tensor | None = None):
        """feats [B, T, F*h] (tapped target states of ids' positions), ids [B, T], anchors [B, N]
        (block positions p: rows at p .. p + L - 1, context rows < p); ``labels`` [B, N, L] (dspark,
        tfm: the teacher-forced previous tokens).  -> block: (logits float32 [B, N, L, V], None);
        dspark: (logits with the Markov head's, confidence logits [B, N, L]); tfm: (the adapter's
        conditional log-probs over each row's candidates [B, N, L, cand_k], the candidates' ids)."""
        hid, toks = self.hidden(feats, ids, anchors)
        logits = F.linear(hid, self.lm_head).float()
        if self.cfg.family == "tfm":
            return self._tfm(hid, logits, toks[..., 0], labels)
        if self.cfg.family != "dspark":
            return logits, None
        prev = torch.cat([toks[..., :1], labels[..., :-1]], -1)                          # teacher-forced chain
        e = F.embedding(prev, self.w("markov.w1"))
        logits = logits + F.linear(e, self.w("markov.w2")).float()
        conf = F.linear(torch.cat([hid.detach(), e.detach()], -1), self.w("conf.w"), self.w("conf.b"))[..., 0]
        return logits, conf

    def _tfm(self, hid, logits, anchor, labels):
        """The adapter along the target's path (``kernels.layers.drafters.tfm``'s ``_expand``, teacher-forced):
        the node at depth d holds the target's token at depth d (the anchor at 0), its state
        s_d = tanh(W_cell [s_{d-1}; E t_d]), its conditional over row d's top-cand_k candidates."""
        top, cand = logits.topk(self.cfg.cand_k, -1)
        base = top - torch.logsumexp(logits, -1, keepdim=True)
        q_in = F.linear(hid, self.w("tfm.in"))
        emb = self.w("tfm.emb")
        toks = torch.cat([anchor[..., None], labels[..., :-1]], -1)
        s = torch.zeros(*toks.shape[:2], emb.shape[1])
        conds = []
        for j in range(toks.shape[-1]):
            s = torch.tanh(F.linear(torch.cat([s, F.embedding(toks[..., j], emb)], -1), self.w("tfm.cell")))
            score = torch.einsum("bna,bnka->bnk", s + q_in[:, :, j], F.embedding(cand[:, :, j], emb))
            conds.append(torch.log_softmax(base[:, :, j] + score.float(), -1))
        return torch.stack(conds, 2), cand

    def hidden(self, feats: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor):
        """The blocks' final-normed rows [B, N, L, h] and their input tokens [B, N, L]."""
        cfg, d = self.cfg, self.cfg.dims
        B, T = ids.shape
        N, L = anchors.shape[1], cfg.block_len
        G = d.Hq // d.Hkv
        kvd = d.Hkv * d.D
        x_ctx = ref.rms_norm(F.linear(feats, self.w("fc")), self.w("hidden_norm"), EPS)     # [B, T, h]
        ctx_pos = torch.arange(T).expand(B, T)
        blk_pos = anchors[..., None] + torch.arange(L)                                   # [B, N, L]
        toks = torch.full((B, N, L), cfg.mask_token, dtype=torch.int64)
        toks[..., 0] = ids.gather(1, anchors)
        x = F.embedding(toks, self.embed)                                                 # [B, N, L, h]
        seen = torch.arange(T)[None, None, :] < anchors[..., None]                       # [B, N, T]
        neg = torch.finfo(torch.float32).min
        for i in range(cfg.layers):
            pre = f"layers.{i}."
            qkv = self.w(pre + "qkv")
            kv = F.linear(x_ctx, qkv[d.q_out:])
            kc, vc = self._heads(kv[..., :kvd], pre + "k_norm", ctx_pos, d.Hkv), kv[..., kvd:].view(B, T, d.Hkv, d.D)
            proj = F.linear(ref.rms_norm(x, self.w(pre + "ln1"), EPS), qkv)
            q = self._heads(proj[..., :d.q_out], pre + "q_norm", blk_pos, d.Hq).view(B, N, L, d.Hkv, G, d.D)
            kb = self._heads(proj[..., d.q_out:d.q_out + kvd], pre + "k_norm", blk_pos, d.Hkv)
            vb = proj[..., d.q_out + kvd:].view(B, N, L, d.Hkv, d.D)
            s_ctx = torch.einsum("bnlhgd,bthd->bnlhgt", q, kc) * d.D ** -0.5
            s_ctx = s_ctx.masked_fill(~seen[:, :, None, None, None, :], neg)
            s_blk = torch.einsum("bnlhgd,bnmhd->bnlhgm", q, kb) * d.D ** -0.5
            a = torch.softmax(torch.cat([s_ctx, s_blk], -1), -1)
            o = torch.einsum("bnlhgt,bthd->bnlhgd", a[..., :T], vc) + \
                torch.einsum("bnlhgm,bnmhd->bnlhgd", a[..., T:], vb)
            x = x + F.linear(o.reshape(B, N, L, d.Hq * d.D), self.w(pre + "o"))
            x = x + F.linear(ref.silu_mul(F.linear(ref.rms_norm(x, self.w(pre + "ln2"), EPS), self.w(pre + "gate_up"))),
                             self.w(pre + "down"))
        return ref.rms_norm(x, self.w("norm"), EPS), toks


@torch.no_grad()
def target_features(target, ids: torch.Tensor, taps) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tapped layers' outputs - the residual stream after each, concatenated as the runtime's
    ``verify(taps=)`` keeps them - [B, T, len(taps) * h], the target's greedy next token [B, T])
    of ids [B, T] through the training module ``target`` (:class:`.target_model.TargetWithMTP`)."""
    layers = target.lm.model.layers
    out: dict[int, torch.Tensor] = {}
    hooks = [layers[i].register_forward_hook(lambda m, a, o, i=i: out.__setitem__(i, o[0] if isinstance(o, tuple) else o))
             for i in taps]
    try:
        h = target.hidden(ids)
    finally:
        for hk in hooks:
            hk.remove()
    return torch.cat([out[i] for i in taps], -1), target.lm.lm_head(h).argmax(-1)


def save_drafter(folder, module: BlockDrafterModule, taps, extra_files: dict | None = None) -> Path:
    """``folder/{config.json, model.safetensors}`` (+ ``extra_files`` {name: text}), each atomic."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = module.cfg
    config = {"schema": DRAFTER_SCHEMA, "family": cfg.family, "target": cfg.model, "hidden_size": cfg.h,
              "vocab_size": cfg.vocab, "taps": list(taps), **{k: getattr(cfg, k) for k in SIZE_FIELDS}}
    tensors = module.tensors()
    write_atomic(folder / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    write_text_atomic(folder / "config.json", json.dumps(config, indent=1) + "\n")
    for name, text in (extra_files or {}).items():
        write_text_atomic(folder / name, text)
    return folder


def read_drafter(folder, family: str | None = None, taps=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(sizes {field: int} for ``drafter_config``, {runtime name: tensor}) of a drafter folder;
    one line for a missing or unreadable one, one of another family, or (``taps``: the target
    layers this target feeds it, ``block_engine.feature_layers``) one trained on other layers."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
        tensors = load_file(folder / "model.safetensors")
    except (OSError, ValueError, SafetensorError) as exc:
        raise SimtreeError(f"drafter folder {folder}: unreadable ({' '.join(str(exc).split())[:120]})") from None
    if not isinstance(config, dict) or config.get("schema") != DRAFTER_SCHEMA:
        raise SimtreeError(f"drafter folder {folder}: config.json is not a {DRAFTER_SCHEMA} config")
    if family is not None and config.get("family") != family:
        raise SimtreeError(f"drafter folder {folder} holds a {config.get('family')!r} drafter, not {family!r}")
    if taps is not None and config.get("taps") != list(taps):
        raise SimtreeError(f"drafter folder {folder} was trained on target layers {config.get('taps')} (config.json "
                           f"'taps'), but this target feeds layers {list(taps)}: retrain it (simtree train-drafter)")
    return {k: int(config[k]) for k in SIZE_FIELDS if k in config}, tensors
