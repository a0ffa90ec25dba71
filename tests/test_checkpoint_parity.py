"""A Qwen3.5 checkpoint written by transformers' own classes decodes in simtree as transformers
runs it (CPU, float32): plain decode logits, every tree node's verify logits, and greedy
generation token for token for plain decoding and every speculative mode the runtime builds.

The model: a tiny random ``Qwen3_5ForCausalLM`` with odd sizes (hidden 36, vocab 101, 3 query
heads over 1 KV head of dim 12 with half of it rotated, 2 GDN key heads of dim 8 under 4 value
heads of dim 6), GDN and gated-attention layers, every weight random (norms far from their
zero init, so the zero-centred ``1 + w`` matters), saved with ``save_pretrained``."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from simtree.planning.simulate import PolicySpec  # noqa: E402
from simtree.runtime.full.build import build_model  # noqa: E402
from simtree.runtime.full.drafting import RUNTIME_MODES, round_shape  # noqa: E402
from simtree.runtime.full.lossless import make_predictable  # noqa: E402

torch.set_num_threads(1)
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82], [50, 50, 1, 99, 7], [11]]
# CPU (the layers' torch forms), and CUDA where there is one (the Triton kernels, CUDA graphs)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                  reason="needs a CUDA device")])]
POLICIES = {"none": {}, "linear": {"budget": 4}, "eagle": {"num_steps": 3, "topk": 2, "budget": 6},
            "best_first": {"budget": 8, "draft_depth": 3}, "cost_aware": {"max_budget": 10, "draft_depth": 3},
            "batch_alloc": {"max_budget_per_seq": 6, "draft_depth": 4}, "block": {"budget": 8, "block_len": 5},
            "tfm": {"budget": 8, "width": 2, "block_len": 5}, "dspark": {"block_len": 5}}
# the block drafters' sizes for a vocabulary of 101 (their public top-512 candidates would not fit)
DRAFTER = {"sizes": {"layers": 1, "cand_k": 32, "adapter_dim": 16, "markov_rank": 32}}


def hf_config(**over):
    from transformers import Qwen3_5TextConfig
    kw = dict(vocab_size=101, hidden_size=36, intermediate_size=52, num_hidden_layers=len(LAYER_TYPES),
              layer_types=LAYER_TYPES, num_attention_heads=3, num_key_value_heads=1, head_dim=16,   # the GPU tree-attention kernel: a power of two >= 16
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
              rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                  "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 1],
                                                  "mrope_interleaved": True})
    kw.update(over)
    return Qwen3_5TextConfig(**kw)


@torch.no_grad()
def randomise(model, seed: int = 0) -> None:
    """Every weight random at a scale that keeps activations O(1): matrices std fan_in^-1/2,
    norms N(0, 0.3) (their 1 + w matters), A_log log U(1, 16), dt_bias N(1, 0.3)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
        elif p.dim() == 1:
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        elif "embed" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            fan_in = p.shape[-1] if "conv1d" in name else p[0].numel()
            p.copy_(torch.randn(p.shape, generator=gen) * fan_in ** -0.5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM
    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(hf_config()).eval()
    randomise(hf)
    path = tmp_path_factory.mktemp("ckpt") / "tiny-qwen3.5"
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module", params=DEVICES)
def model(checkpoint, request):
    return build_model(str(checkpoint[1]), device=request.param, dtype=torch.float32)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def close(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |diff| relative to the logits' scale (their max magnitude)."""
    return float((ours - ref).abs().max() / ref.abs().max())


def test_the_checkpoint_loads_whole_and_says_its_mtp_layer_is_random(model):
    assert model.d.theta == 500.0 and model.d.rope == 8   # partial_rotary_factor 0.5 of head_dim 16
    assert all(n.startswith("mtp.") for n in model.random_weights) and model.random_weights
    assert len(model.load_notes) == 1 and "randomly initialised MTP layer" in model.load_notes[0]


def test_plain_decode_logits_equal_transformers_forward(checkpoint, model):
    hf, _ = checkpoint
    B, T = 2, 9
    ids = torch.randint(0, 101, (B, T), generator=torch.Generator().manual_seed(1))
    st = model.new_state(B, 32)
    ours = torch.stack([model.logits(model.decode(st, ids[:, t].to(model.device))) for t in range(T)], 1).cpu()
    for b in range(B):
        assert close(ours[b], hf_logits(hf, ids[b].tolist())) <= 1e-4


def test_bf16_decode_logits_are_as_close_to_float32_as_transformers_own_bf16(checkpoint):
    """bf16 within bf16 rounding: simtree's bf16 logits are no farther from the float32 forward
    than transformers' own bf16 forward is (both measured relative to the logits' scale)."""
    import copy
    hf, path = checkpoint
    ids = torch.randint(0, 101, (2, 10), generator=torch.Generator().manual_seed(3))
    ref = torch.stack([hf_logits(hf, ids[b].tolist()) for b in range(2)])
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    theirs = torch.stack([hf_logits(hf_bf16, ids[b].tolist()) for b in range(2)])
    model = build_model(str(path), device="cpu", dtype=torch.bfloat16)
    st = model.new_state(2, 16)
    ours = torch.stack([model.logits(model.decode(st, ids[:, t])) for t in range(ids.shape[1])], 1)
    def mean_rel(x):   # bf16's error is rounding noise: its mean magnitude, relative to the logits'
        return float((x - ref).abs().mean() / ref.abs().mean())
    assert mean_rel(ours) <= 2 * mean_rel(theirs), (mean_rel(ours), mean_rel(theirs))
    assert close(ours, ref) <= 3 * close(theirs, ref)


def test_tree_verify_logits_equal_transformers_over_each_root_path(checkpoint, model):
    hf, _ = checkpoint
    gen = torch.Generator().manual_seed(2)
    prefixes = [[5, 6, 7, 8, 9], [40, 41, 42, 43, 44]]
    B, n = 2, 7
    st = model.new_state(B, 32)
    pre = torch.tensor(prefixes, device=model.device)
    for t in range(pre.shape[1]):
        model.decode(st, pre[:, t])
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 5], [-1, 0, 1, 2, 0, 4, 4]])
    tokens = torch.randint(0, 101, (B, n), generator=gen)
    hidden, _ = model.verify(st, tokens.to(model.device), parents.to(model.device))
    logits = model.logits(hidden).view(B, n, -1).cpu()
    for b in range(B):
        for j in range(n):
            path, k = [], j
            while k >= 0:
                path.append(int(tokens[b, k]))
                k = int(parents[b, k])
            ref = hf_logits(hf, prefixes[b] + path[::-1])[-1]
            assert close(logits[b, j], ref) <= 1e-4, (b, j)


def hf_generate(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference_outputs(checkpoint):
    return [hf_generate(checkpoint[0], p, 64) for p in PROMPTS]


@pytest.mark.parametrize("mode", RUNTIME_MODES)
def test_greedy_generation_equals_transformers_for_every_mode(checkpoint, model, reference_outputs, mode):
    # the random MTP layer made to agree with the target often, so rounds accept and reject
    if mode not in POLICIES:
        pytest.fail(f"the runtime builds mode {mode!r}: add its parameters to POLICIES")
    if mode != "none":
        make_predictable(model, 1.0)
    from full_helpers import drafter_costs    # what cost_aware / batch_alloc / DSpark's schedule decide with
    from simtree.runtime.full.block_engine import make_engine
    engine = make_engine(model, round_shape(PolicySpec.from_dict(mode, POLICIES[mode])), len(PROMPTS), 160,
                         costs=drafter_costs(), **DRAFTER)
    engine.capture()   # CUDA graphs on a GPU; nothing on the CPU
    engine.prefill(PROMPTS)
    stats = engine.run(max_new_tokens=64)
    assert [o[:64] for o in engine.outputs()] == reference_outputs
    if mode != "none":
        assert stats.accepted.sum() > 0   # drafts were accepted: the rounds' commit paths ran


def test_the_run_contract_decodes_given_prompts_as_transformers_does(checkpoint, tmp_path):
    """``simtree run --model PATH --prompt-ids ... --json``: outputs in the JSON and in run.json,
    the same for plain and speculative modes, equal to transformers' greedy generate."""
    import json

    from typer.testing import CliRunner

    from simtree.cli import app
    hf, path = checkpoint
    prompts, n = [[4, 8, 15, 16], [23, 42]], 12
    want = [hf_generate(hf, p, n) for p in prompts]
    for mode in ("plain", "linear", "eagle"):
        out = tmp_path / mode
        args = ["run", "--model", str(path), "--device", "cpu", "--dtype", "float32", "--max-new-tokens", str(n),
                "--mode", mode, "--budget", "4", *(["--steps", "2", "--topk", "2"] if mode == "eagle" else []),
                "--out", str(out), "--json"]
        for p in prompts:
            args += ["--prompt-ids", ",".join(map(str, p))]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert report["outputs"] == want, mode
        assert json.loads((out / "run.json").read_text())["outputs"] == want
        assert bool(report["notes"]) == (mode != "plain")   # the random MTP layer said once, where it drafts


def test_the_vision_language_wrapper_decodes_as_its_text_model(tmp_path):
    """model_type qwen3_5 (the published checkpoints' kind), saved by transformers'
    Qwen3_5ForConditionalGeneration: simtree reads text_config and model.language_model.*, leaves
    the vision tower, and decodes text as transformers' wrapper does."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    vision = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=36, patch_size=4,
                  temporal_patch_size=1, num_position_embeddings=16)
    hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=hf_config().to_dict(), vision_config=vision)).eval()
    randomise(hf, seed=4)
    hf.save_pretrained(tmp_path / "vl")
    model = build_model(str(tmp_path / "vl"), device="cpu", dtype=torch.float32)
    ids = torch.tensor([[5, 9, 33, 2, 71, 100]])
    st = model.new_state(1, 16)
    ours = torch.stack([model.logits(model.decode(st, ids[:, t])) for t in range(ids.shape[1])], 1)[0]
    with torch.no_grad():
        ref = hf(input_ids=ids).logits[0].float()
    assert close(ours, ref) <= 1e-4


def test_a_checkpoint_mtp_layer_runs_as_sglang_builds_it(checkpoint, tmp_path):
    """With mtp.* tensors in the folder (as the published checkpoints ship them) the drafter is
    that layer: fc over [pre_fc_norm_embedding(embed); pre_fc_norm_hidden(hidden)], one
    full-attention decoder layer (transformers' own Qwen3_5DecoderLayer as the reference), then
    mtp.norm - SGLang's qwen3_5_mtp.py structure, every norm zero-centred."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer, Qwen3_5RMSNorm,
                                                              Qwen3_5TextRotaryEmbedding)

    from simtree.checkpoints import open_checkpoint
    from simtree.kernels.layers.attention import chain_bits
    from simtree.models import get_model
    hf, path = checkpoint
    folder = tmp_path / "with-mtp"
    shutil.copytree(path, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    ckpt = open_checkpoint(folder)
    plan = ckpt.family.tensor_plan(ckpt.config, get_model(str(folder)))
    gen = torch.Generator().manual_seed(5)
    mtp = {k: (0.3 * torch.randn(s, generator=gen) if len(s) == 1 else torch.randn(s, generator=gen) * s[-1] ** -0.5)
           for k, s in plan.optional["MTP layer"].items()}
    save_file({**tensors, **mtp}, str(folder / "model.safetensors"))
    model = build_model(str(folder), device="cpu", dtype=torch.float32)
    assert model.random_weights == [] and model.load_notes == []

    T, h = 6, hf.config.hidden_size
    tokens = torch.randint(0, 101, (1, T), generator=gen)
    hidden = torch.randn(1, T, h, generator=gen)
    st = model.new_state(1, 16)
    ds = model.new_draft_state(st, T)
    rows = torch.arange(T)[None]   # row t: position t, sees rows 0..t (a causal chain)
    ours = model.draft_forward(ds, tokens, hidden, rows, rows, chain_bits(1, T, "cpu"))[0]

    cfg = hf.config
    def norm(key):
        n = Qwen3_5RMSNorm(h, cfg.rms_norm_eps)
        n.weight.data.copy_(mtp[key])
        return n
    layer = Qwen3_5DecoderLayer(cfg, LAYER_TYPES.index("full_attention")).eval()
    layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in mtp.items() if k.startswith("mtp.layers.0.")})
    with torch.no_grad():
        e = norm("mtp.pre_fc_norm_embedding.weight")(hf.model.embed_tokens(tokens))
        x = torch.cat([e, norm("mtp.pre_fc_norm_hidden.weight")(hidden)], -1) @ mtp["mtp.fc.weight"].t()
        pos = torch.arange(T)[None]
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
        x = layer(x, position_embeddings=Qwen3_5TextRotaryEmbedding(cfg)(x, pos), attention_mask=causal,
                  position_ids=pos)
        ref = norm("mtp.norm.weight")(x)[0]
    assert close(ours, ref) <= 1e-4


@pytest.mark.parametrize("variant", ["sharded", "tied"])
def test_a_sharded_or_tied_save_loads(checkpoint, tmp_path, variant):
    """save_pretrained(max_shard_size=...) writes model.safetensors.index.json and shards; a
    model with tie_word_embeddings saves no lm_head.weight (the embedding is the LM head)."""
    from transformers import Qwen3_5ForCausalLM
    hf = checkpoint[0]
    if variant == "tied":
        hf = Qwen3_5ForCausalLM(hf_config(tie_word_embeddings=True)).eval()
        randomise(hf, seed=6)
    hf.save_pretrained(tmp_path / variant, **({"max_shard_size": "40KB"} if variant == "sharded" else {}))
    assert (tmp_path / variant / "model.safetensors.index.json").is_file() == (variant == "sharded")
    model = build_model(str(tmp_path / variant), device="cpu", dtype=torch.float32)
    ids = torch.tensor([[7, 3, 99, 42]])
    st = model.new_state(1, 8)
    ours = torch.stack([model.logits(model.decode(st, ids[:, t])) for t in range(ids.shape[1])], 1)[0]
    assert close(ours, hf_logits(hf, ids[0].tolist())) <= 1e-4
