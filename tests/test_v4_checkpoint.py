"""DeepSeek-V4 checkpoints against transformers (the oracle): a tiny random
DeepseekV4ForCausalLM (odd sizes; sliding / CSA / HCA layers; hash and routed MoE; YaRN on the
compressed layers; ratios 4 and 8 so that compressed entries complete inside the prompts) saved
with save_pretrained, loaded by simtree; float32 on the CPU."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from simtree.errors import SimtreeError

transformers = pytest.importorskip("transformers")

from v4_checkpoint_helpers import save_tiny  # noqa: E402

VOCAB = 101


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4ckpt")
    hf = save_tiny(path)
    from simtree.runtime.full.v4_rank import V4Rank
    notes = []
    rank = V4Rank.from_checkpoint(path, device="cpu", dtype=torch.float32, note=notes.append)
    return path, hf, rank, notes


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0]


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_the_shape_comes_from_the_config(ckpt):
    path, hf, rank, notes = ckpt
    c = hf.config
    assert rank.shape.layer_kinds == ("swa", "csa", "hca", "csa", "hca")
    assert rank.d.hash_layers == (0, 1) and rank.d.hc == c.hc_mult and rank.d.rope == 8
    assert (rank.d.csa, rank.d.hca, rank.d.window, rank.d.E) == (4, 8, c.sliding_window, c.n_routed_experts)
    # save_pretrained drops the MTP layer: one line says the drafter is random
    assert len(notes) == 1 and "random MTP" in notes[0]


@torch.no_grad()
def test_plain_decode_logits_equal_transformers(ckpt):
    """Every position of a 44-token prompt decoded one token at a time: the logits are
    transformers' full forward's (CSA / HCA entries complete from position 3 / 7 on)."""
    _, hf, rank, _ = ckpt
    ids = _prompt(44, 1)
    ref = _hf_logits(hf, ids)
    st = rank.new_state(1, 64)
    out = torch.stack([rank.logits(rank.decode(st, torch.tensor([t])))[0] for t in ids])
    assert _close(out, ref) <= 1e-4


@torch.no_grad()
@pytest.mark.parametrize("hc_form", ["torch", "fused"])
def test_tree_verify_logits_equal_transformers_over_each_root_path(ckpt, hc_form):
    """A 9-node tree after a 21-token prefix (its paths cross a C4 and a C8 boundary, the window
    slides): each node's logits are transformers' forward over prefix + the node's root path;
    with the hyper-connections in either form (the layer form v4_hc)."""
    from simtree.kernels.layers.forms import forms
    _, hf, rank, _ = ckpt
    prefix = _prompt(21, 2)
    st = rank.new_state(1, 64)
    with forms(v4_hc=hc_form):
        for t in prefix[:-1]:
            rank.decode(st, torch.tensor([t]))
        parents = [-1, 0, 1, 2, 0, 4, 3, 6, 5]
        tokens = [prefix[-1]] + _prompt(8, 3)
        hidden, _ = rank.verify(st, torch.tensor([tokens]), torch.tensor([parents]))
        out = rank.logits(hidden)
    for node in range(len(parents)):
        path, u = [], node
        while u >= 0:
            path.append(tokens[u])
            u = parents[u]
        ref = _hf_logits(hf, prefix[:-1] + path[::-1])[-1]
        assert _close(out[node], ref) <= 1e-4, node


@pytest.fixture(scope="module")
def ckpt_all_entries(tmp_path_factory):
    """The same tiny model with index_topk above every entry count of the generation test: the
    indexer's ReLU scores tie exactly (at 0) often in a random model, and which of tied entries
    a top-k keeps is the implementation's choice (transformers' and simtree's differ); the
    selection itself is checked by the two tests above."""
    path = tmp_path_factory.mktemp("v4ckpt_all")
    hf = save_tiny(path, index_topk=32)
    from simtree.runtime.full.v4_rank import V4Rank
    return path, hf, V4Rank.from_checkpoint(path, device="cpu", dtype=torch.float32, note=lambda s: None), []


@torch.no_grad()
def test_greedy_generation_equals_transformers_for_every_runtime_mode(ckpt_all_entries):
    """4 prompts x 64 new tokens: plain greedy decoding is transformers' greedy generation token
    for token, and every speculative mode the runtime builds (random MTP) gives the same tokens."""
    from simtree.planning.simulate import PolicySpec
    from simtree.runtime.full.drafting import RUNTIME_MODES
    from simtree.runtime.full.lossless import check_lossless
    from simtree.runtime.full.drafting import round_shape
    from full_helpers import drafter_costs
    from simtree.planning.modes import BLOCK_DRAFTER_MODES
    from simtree.runtime.full.engine import FullEngine

    _, hf, rank, _ = ckpt_all_entries
    new = 64
    prompts = [_prompt(n, 10 + i) for i, n in enumerate((9, 14, 17, 23))]
    engine = FullEngine(rank, round_shape(PolicySpec.from_dict("none")), len(prompts), 128, graphs=False)
    engine.prefill(prompts)
    engine.run(max_new_tokens=new)
    plain = [o[:new] for o in engine.outputs()]
    for p, o in zip(prompts, plain):
        # greedy by transformers' forward: each output token is the argmax of the forward over
        # the prompt and the tokens before it (one causal forward over the whole sequence checks
        # them all).  transformers' own generate() runs its cache path, which for this model
        # type does not always reproduce its forward (docs/models.md)
        ref = _hf_logits(hf, p + o)[len(p) - 1:-1].argmax(-1).tolist()
        assert o == ref
    specs = {"linear": PolicySpec.from_dict("linear", {"budget": 4}),
             "eagle": PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6}),
             "best_first": PolicySpec.from_dict("best_first", {"budget": 8, "draft_depth": 3}),
             "cost_aware": PolicySpec.from_dict("cost_aware", {"max_budget": 10, "draft_depth": 3}),
             "batch_alloc": PolicySpec.from_dict("batch_alloc", {"max_budget_per_seq": 6, "draft_depth": 4}),
             "block": PolicySpec.from_dict("block", {"budget": 8, "block_len": 5}),
             "tfm": PolicySpec.from_dict("tfm", {"budget": 8, "width": 2, "block_len": 5}),
             "dspark": PolicySpec.from_dict("dspark", {"block_len": 5})}
    assert set(specs) == set(RUNTIME_MODES) - {"none"}
    blocks = [specs.pop(m) for m in BLOCK_DRAFTER_MODES]
    rows = check_lossless(rank, prompts, list(specs.values()), new, 128 + 16 * new, costs=drafter_costs())
    # the block drafters (tiny drafters: their public top-512 would pass this vocabulary) over 24 tokens
    rows += check_lossless(rank, prompts, blocks, 24, 128 + 16 * new, costs=drafter_costs(),
                           drafter={"sizes": {"layers": 1, "cand_k": 32, "adapter_dim": 16, "markov_rank": 32}})
    assert all(r["match"] for r in rows), rows


# ---- bad input: one line, naming the problem -------------------------------------------------------
def _copy(ckpt, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(ckpt[0], dst)
    return dst


def _load(path):
    from simtree.runtime.full.v4_rank import V4Rank
    return V4Rank.from_checkpoint(path, device="cpu", dtype=torch.float32, note=lambda s: None)


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(SimtreeError, match="no config.json"):
        _load(tmp_path)


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(model_type="llama"), "model_type 'llama'"),
    (lambda c: c.pop("q_lora_rank"), "missing q_lora_rank"),
    (lambda c: c.update(scoring_func="softmax"), "scoring_func"),
])
def test_a_bad_config_is_refused(ckpt, tmp_path, edit, match):
    path = _copy(ckpt, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SimtreeError, match=match):
        _load(path)


def test_a_missing_extra_or_misshapen_tensor_is_named(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file
    path = _copy(ckpt, tmp_path)
    file = path / "model.safetensors"
    tensors = load_file(file)
    key = "model.layers.1.attn.wq_b.weight"
    for change, match in ((lambda t: t.pop(key), f"missing tensor {key}"),
                          (lambda t: t.update(extra=torch.zeros(2)), "unexpected tensor extra"),
                          (lambda t: t.update({key: t[key][:-1]}), rf"{key} has shape \(95, 20\), the config needs "
                                                                   r"\(96, 20\)")):
        bad = dict(tensors)
        change(bad)
        save_file(bad, file)
        with pytest.raises(SimtreeError, match=match):
            _load(path)
    file.write_bytes(file.read_bytes()[:1000])
    with pytest.raises(SimtreeError, match="not a readable safetensors file"):
        _load(path)


# ---- expert parallelism, the MTP layer ------------------------------------------------------------
def test_an_expert_parallel_rank_reads_its_own_experts(ckpt):
    from safetensors.torch import load_file
    from simtree.runtime.full.v4_rank import V4Rank
    path = ckpt[0]
    raw = load_file(path / "model.safetensors")
    rank = V4Rank.from_checkpoint(path, device="cpu", dtype=torch.float32, ep_rank=1, ep_ranks=2,
                                  note=lambda s: None)
    assert rank.d.E == 3 and rank.ep_ranks == 2
    p = "model.layers.2.ffn."
    torch.testing.assert_close(rank.w["layers.2.router"], raw[p + "gate.weight"][3:6])
    torch.testing.assert_close(rank.w["layers.2.router_bias"], raw[p + "gate.bias"][3:6])
    for j, e in enumerate(range(3, 6)):
        q = f"{p}experts.{e}."
        torch.testing.assert_close(rank.w["layers.2.experts_gu"][j], torch.cat([raw[q + "w1.weight"], raw[q + "w3.weight"]]))
        torch.testing.assert_close(rank.w["layers.2.experts_down"][j], raw[q + "w2.weight"])
    assert int(rank.w["layers.0.tid2eid"].max()) < 3            # hash ids of the rank's own experts
    st = rank.new_state(1, 16)
    assert rank.logits(rank.decode(st, torch.tensor([5]))).isfinite().all()
    with pytest.raises(SimtreeError, match="do not make rank"):
        V4Rank.from_checkpoint(path, device="cpu", dtype=torch.float32, ep_ranks=4, note=lambda s: None)


def _mtp_tensors(rank) -> dict:
    """The rank's MTP weights under the released checkpoint's ``mtp.0.*`` names (the loader's
    mapping inverted: rope rows back to interleaved, fused projections split)."""
    from simtree.checkpoints.deepseek_v4 import rope_perm
    d, w = rank.d, {k[4:]: v for k, v in rank.w.items() if k.startswith("mtp.")}

    def unperm(t, dim=0):
        inv = torch.argsort(rope_perm(d.D, d.rope))
        n = t.shape[dim] // d.D
        return t.index_select(dim, (inv[None, :] + d.D * torch.arange(n)[:, None]).reshape(-1))
    out = {f"{k}.weight": w[k] for k in ("enorm", "hnorm", "e_proj", "h_proj", "norm")}
    out.update({f"hc_head_{k}": w[f"hc_head_{k}"] for k in ("fn", "base", "scale")})
    out.update({"attn_norm.weight": w["ln1"], "ffn_norm.weight": w["ln2"], "attn.wq_a.weight": w["wqkv_a"][:d.qr],
                "attn.wkv.weight": unperm(w["wqkv_a"][d.qr:]), "attn.q_norm.weight": w["q_norm"],
                "attn.wq_b.weight": unperm(w["wq_b"]), "attn.kv_norm.weight": unperm(w["kv_norm"]),
                "attn.wo_a.weight": unperm(w["wo_a"].reshape(d.G * d.orank, -1), 1), "attn.wo_b.weight": w["wo_b"],
                "attn.attn_sink": w["sink"], "ffn.gate.weight": w["router"], "ffn.gate.bias": w["router_bias"],
                "ffn.shared_experts.w1.weight": w["shared_gu"][:d.Is], "ffn.shared_experts.w3.weight": w["shared_gu"][d.Is:],
                "ffn.shared_experts.w2.weight": w["shared_down"]})
    for e in range(d.E):
        out.update({f"ffn.experts.{e}.w1.weight": w["experts_gu"][e, :d.I],
                    f"ffn.experts.{e}.w3.weight": w["experts_gu"][e, d.I:],
                    f"ffn.experts.{e}.w2.weight": w["experts_down"][e]})
    out.update({f"{which}_{k}": w[f"{which}_{k}"] for which in ("hc_attn", "hc_ffn") for k in ("fn", "base", "scale")})
    return {"mtp.0." + k: v.contiguous() for k, v in out.items()}


def test_mtp_weights_under_the_released_names_are_the_drafter(ckpt, tmp_path):
    """A checkpoint with ``mtp.0.*`` tensors: they are the MTP layer (no note), mapped exactly
    (the random drafter written out and read back drafts the same logits)."""
    from safetensors.torch import load_file, save_file
    from simtree.runtime.full.v4_rank import V4Rank
    _, _, rank, _ = ckpt
    path = _copy(ckpt, tmp_path)
    file = path / "model.safetensors"
    save_file({**load_file(file), **_mtp_tensors(rank)}, file)
    notes = []
    again = V4Rank.from_checkpoint(path, device="cpu", dtype=torch.float32, seed=7, note=notes.append)
    assert notes == []
    for k, v in rank.w.items():
        if k.startswith("mtp."):
            torch.testing.assert_close(again.w[k], v, rtol=0, atol=0)
    bad = load_file(file)
    bad.pop("mtp.0.h_proj.weight")
    save_file(bad, file)
    with pytest.raises(SimtreeError, match="mtp.0.h_proj.weight of the MTP layer"):
        _load(path)


def test_the_shipped_v4_flash_config_is_the_registry_shape():
    """simtree/data/models/deepseek-v4-flash/config.json (the released config's fields) is the
    registry's DeepSeek-V4-Flash shape, with V4's semantics' fields and FP8 experts (its
    quantization_config: FP4 experts converted to FP8 on load)."""
    from simtree.data import data_path
    from simtree.kernels.layers.v4 import V4Dims, model_specs
    from simtree.models import get_model, hash_layers, shape_from_config
    shape = shape_from_config(data_path("models") / "deepseek-v4-flash", "deepseek-v4-flash")
    reg = get_model("deepseek-v4-flash")
    assert reg.source.endswith("deepseek-v4-flash/config.json")
    assert (shape.hidden, shape.vocab, shape.layer_kinds, shape.mlp, shape.v4) == \
        (reg.hidden, reg.vocab, reg.layer_kinds, reg.mlp, reg.v4)
    assert (shape.hidden, shape.vocab, shape.num_layers, shape.mlp["n_experts"]) == (4096, 129280, 43, 256)
    assert reg.mlp["expert_dtype"] == "fp8"
    d = V4Dims.of(shape, 8)
    assert d.experts == "fp8"
    gu = {s.name: s for s in model_specs(shape.shard("ep=8"), None) if s.name.startswith("layers.3.experts_gu")}
    assert gu["layers.3.experts_gu"].dtype == torch.float8_e4m3fn
    assert gu["layers.3.experts_gu_scale_inv"].shape == (32, 2 * 2048 // 128, 4096 // 128)
    assert (d.hc, d.hc_iters, d.theta, d.ctheta, d.limit, d.route_scale) == (4, 20, 1e4, 1.6e5, 10.0, 1.5)
    assert dict(d.yarn)["factor"] == 16 and hash_layers(shape) == (0, 1, 2)
