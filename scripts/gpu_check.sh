#!/usr/bin/env bash
# On a bare GPU machine (torch, transformers and peft only: no `make venv`, no embedded model, no vLLM, one GPU)
# run scripts/gpu_check.py instead: FSDP2 at world size 1, the bf16 sampler-trainer mismatch, the LM head's and a
# packed tree's memory and the weight sync's cost on random models, in minutes (docs/gpus.md). This script is the
# long end-to-end run for a full GPU machine with vLLM.
#
# The checks that need a GPU, as one script (lightning_lite/extras/vllm.py: the vLLM backend; extras/fsdp.py: FSDP2). From the repo root:
#
#   scripts/gpu_check.sh            # GPUs: the embedded 135M model and a random 1.4B Qwen2-shaped model
#   SMOKE=1 scripts/gpu_check.sh    # CPU: the same runs on a tiny random model and 2 gloo ranks (checks the script)
#
# Each model trains two steps (tests/harnesses.py LengthHarness: reward = reply length, so every step
# updates) these ways: DDP with the embedded backend (--dtype bf16, the GPU default; also fp32, with
# --activation-checkpointing, --no-tree, and fp32 under --attn flex_attention); FSDP with the embedded backend (>= 2 GPUs; also with --kl-coef: a sharded bf16
# reference model); LoRA (--lora 16: bf16 and fp32 under DDP, FSDP with --kl-coef); DDP with vLLM servers on the same GPUs, asleep while the trainer computes
# (--backend vllm --vllm-sleep --max-model-len 16384, past the trained context; when `make setup-vllm` can
# install vLLM); and grammar-constrained calls on both backends (tests/harnesses.py SamplingHarness). From step 2 (warm) it prints seconds by phase (rollout, train,
# sleep, weight sync), generation and training tokens/s, peak GPU memory of the trainer, model-FLOPs
# utilization of the training phase (6 x params x tokens through the model per second per GPU, against its dense bf16 peak;
# PEAK_TFLOPS overrides it) and the rollout/trainer mismatch. No model hub is needed: the 1.4B model is
# randomly initialized (SmolLM2's tokenizer, so its vocabulary is 49,152).
# Placement (GPUs, with vLLM): one trainer rank on GPU 0 with a vLLM server beside it (default share 0.3, then
# 0.5), and with >= 2 GPUs servers on GPUs of their own (--vllm-gpus; tensor-parallel over two with >= 3):
# nvidia-smi's peak memory.used per GPU, sampled during each run, must show each server where asked, with its share.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/gpu_check}
SMOKE=${SMOKE:-0}
mkdir -p "$OUT"
[ -x "$PY" ] || make venv || exit 1
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$SMOKE" = 1 ]; then NPROC=2; SIZES="tiny"; STEP="--batch-size 2 --group-size 2 --max-new-tokens 8"
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}; VLLM_ARGS=${VLLM_ARGS:---max-model-len 2048}
elif [ "$NGPU" -ge 1 ]; then NPROC=$NGPU; SIZES="embedded 1.4b"; STEP="--batch-size $((8 * NGPU)) --group-size 4 --max-new-tokens 128"
else echo "no GPU here (torch.cuda.device_count() is 0): run it on a GPU machine, or SMOKE=1 on a CPU"; exit 1; fi

# A random Qwen2-shaped model in transformers format (1.4B: Qwen2.5-1.5B's layers and widths).
make_model() {
  $PY - "$1" "$2" <<'EOF'
import sys, torch, transformers
import lightning_lite.extras.embedded  # the embedded model by name
from lightning_lite.models import load_tokenizer
size, out = sys.argv[1], sys.argv[2]
tok = load_tokenizer("smollm2")
shape = {"1.4b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2),
         "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)}[size]
cfg = transformers.Qwen2Config(vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=True,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **shape)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
model.save_pretrained(out)
tok.save_pretrained(out)
print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")
EOF
}

run() {  # run NAME MODEL ARGS...: two steps, logs in OUT/NAME.log
  local name=$1 model=$2; shift 2
  rm -rf "$OUT/$name"
  echo "== $name"
  $PY -m torch.distributed.run --standalone --nproc_per_node "$NPROC" train.py --model "$model" --harness "${HARNESS:-tests/harnesses.py:LengthHarness}" \
      --harness-arg max_tokens=128 --steps 2 --eval-tasks 0 --lr 1e-5 --out "$OUT/$name" $STEP "$@" > "$OUT/$name.log" 2>&1 \
    || { echo "   failed: see $OUT/$name.log"; tail -5 "$OUT/$name.log"; }
}

VLLM=0
if [ "$SMOKE" = 1 ] && [ -x .venv-vllm/bin/python ]; then VLLM=1
elif [ "$SMOKE" != 1 ] && make setup-vllm > "$OUT/setup-vllm.log" 2>&1; then VLLM=1
else echo "vLLM not available (see $OUT/setup-vllm.log): skipping the vLLM runs"; fi

for size in $SIZES; do
  model=smollm2
  if [ "$size" != embedded ]; then model="$OUT/model-$size"; [ -f "$model/config.json" ] || make_model "$size" "$model"; fi
  run "$size-ddp" "$model" --parallel ddp
  run "$size-ddp-ckpt" "$model" --parallel ddp --activation-checkpointing
  run "$size-ddp-rows" "$model" --parallel ddp --no-tree  # against size-ddp: train s and fwd tokens without tree packing
  # the packed tree's mask as a FlexAttention block mask (compiled; forward only on CPUs): fp32 |dlogp| ~1e-5 as sdpa's
  [ "$SMOKE" != 1 ] && run "$size-flex-fp32" "$model" --parallel ddp --dtype fp32 --attn flex_attention
  [ "$NPROC" -ge 2 ] && run "$size-fsdp" "$model" --parallel fsdp
  [ "$NPROC" -ge 2 ] && run "$size-fsdp-kl" "$model" --parallel fsdp --kl-coef 0.01  # the reference model sharded too
  run "$size-fp32" "$model" --parallel ddp --dtype fp32  # the GPU default is bf16: fp32 gives |dlogp| ~1e-5
  # LoRA: the base frozen in bf16, AdamW over the adapters (peak memory against $size-ddp), fp32 |dlogp| ~1e-5;
  # under FSDP the adapters sharded with their layers, the KL reference the base with its adapters disabled
  run "$size-lora" "$model" --parallel ddp --lora 16 --lr 1e-4
  run "$size-lora-fp32" "$model" --parallel ddp --lora 16 --lr 1e-4 --dtype fp32
  [ "$NPROC" -ge 2 ] && run "$size-fsdp-lora-kl" "$model" --parallel fsdp --lora 16 --lr 1e-4 --kl-coef 0.01
  # LoRA on vLLM: the servers serve the base and load each sync's adapters (MBs, t_sync against $size-vllm's)
  [ "$VLLM" = 1 ] && run "$size-vllm-lora" "$model" --backend vllm --serve-dtype bf16 --lora 16 --lr 1e-4 --vllm-args "${VLLM_ARGS:-}"
  # past the trained context: trainer and servers scale RoPE alike (YaRN), or prob_corr drops
  [ "$VLLM" = 1 ] && run "$size-vllm" "$model" --backend vllm --serve-dtype bf16 --vllm-sleep --max-model-len 16384 --vllm-args "${VLLM_ARGS:-}"
  # grammar-constrained calls (a forced tool call, a JSON reply): the trainer replays the masks, fp32 |dlogp| ~1e-5;
  # on vLLM its guidance backend masks on the GPU: |dlogp| at the bf16 level of $size-vllm, not ~2 (no mask)
  HARNESS=tests/harnesses.py:SamplingHarness run "$size-grammar-fp32" "$model" --harness-arg "setting='constrained'" --dtype fp32
  [ "$VLLM" = 1 ] && HARNESS=tests/harnesses.py:SamplingHarness run "$size-vllm-grammar" "$model" --harness-arg "setting='constrained'" \
      --backend vllm --serve-dtype bf16 --vllm-args "${VLLM_ARGS:-}"
done

place() {  # place NAME EXPECTED ARGS...: one rank on GPU 0; EXPECTED: "gpu=share ..." where the servers must be
  local name=$1 expected=$2; shift 2
  rm -rf "$OUT/$name"
  echo "== $name: expect $expected (GPU 0 also holds the trainer)"
  (while :; do nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits; sleep 1; done) > "$OUT/$name.smi" &
  local smi=$!
  $PY train.py --model smollm2 --harness tests/harnesses.py:LengthHarness --harness-arg max_tokens=32 --steps 1 --eval-tasks 0 \
      --batch-size 2 --group-size 2 --max-new-tokens 32 --backend vllm --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1 \
    || { echo "   failed: see $OUT/$name.log"; tail -5 "$OUT/$name.log"; }
  kill "$smi"
  $PY - "$OUT/$name.smi" $expected <<'EOF'
import sys
peak, total = {}, {}
for line in open(sys.argv[1]):
    i, used, tot = (int(x) for x in line.split(","))
    peak[i], total[i] = max(peak.get(i, 0), used), tot
share = {i: peak[i] / total[i] for i in sorted(total)}
want = {int(g): float(s) for g, s in (e.split("=") for e in sys.argv[2:])}
# a server holds its share from start-up (weights, KV cache), no more; the trainer (GPU 0) adds < 0.1 (135M model)
bad = [i for i, s in share.items() if not want.get(i, 0) - 0.05 <= s <= want.get(i, 0) + (0.1 if i == 0 else 0.05)]
print("   peak memory.used / total by GPU:", ", ".join(f"{i}: {s:.2f}" for i, s in share.items()), "MISPLACED" if bad else "ok")
EOF
}
if [ "$VLLM" = 1 ] && [ "$SMOKE" != 1 ]; then
  place place-beside "0=0.3"
  place place-beside-0.5 "0=0.5" --vllm-gpu-memory 0.5
  [ "$NGPU" -ge 2 ] && place place-own "1=0.9" --vllm-gpus 1
  [ "$NGPU" -ge 3 ] && place place-own-tp2 "1=0.9 2=0.9 0=0.3" --vllm-gpus 1,2 0
fi

$PY - "$OUT" <<'EOF'
import json, os, sys
import torch
out = sys.argv[1]
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
peaks = {"H200": 989, "H100": 989, "A100": 312, "L40S": 362, "A10": 125, "L4": 121}  # dense bf16 TFLOPS
peak = float(os.environ.get("PEAK_TFLOPS") or next((v for k, v in peaks.items() if k in name), 0)) * 1e12
print(f"\n{name}; MFU against {peak / 1e12:.0f} TFLOPS per device" if peak else f"\n{name}: no peak FLOPS known, no MFU (set PEAK_TFLOPS)")
print(f"{'run':18} {'rollout s':>9} {'train s':>8} {'sleep s':>7} {'sync s':>7} {'gen tok/s':>9} {'train tok/s':>11} {'fwd tok':>8} {'peak GB':>8} {'MFU':>6} {'prob_corr':>9} {'|dlogp|':>8}")
for run in sorted(d for d in os.listdir(out) if os.path.isfile(os.path.join(out, d, "metrics.jsonl"))):
    rows = [r for r in map(json.loads, open(os.path.join(out, run, "metrics.jsonl"))) if "reward" in r]
    cfg = json.load(open(os.path.join(out, run, "config.json")))
    if not rows:
        continue
    r = rows[-1]
    model = cfg["model"] if os.path.isdir(cfg["model"]) else os.path.expanduser("~/.cache/lightning-lite/smollm2")
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(model)
    h, L, V, I = c.hidden_size, c.num_hidden_layers, c.vocab_size, c.intermediate_size
    kv = c.num_key_value_heads * h // c.num_attention_heads
    params = V * h + L * (2 * h * h + 2 * h * kv + 3 * h * I)  # embeddings (tied) + attention + MLP
    fwd = r.get("fwd_tokens") or 0  # what the model computed (a packed tree: each shared prefix once), not the samples' tokens
    mfu = f"{fwd / (r['t_train'] * cfg.get('world_size', 1)) * 6 * params / peak:.1%}" if peak else "-"
    corr = f"{r['prob_corr']:.4f}" if r.get("prob_corr") is not None else "-"
    print(f"{run:18} {r['t_rollout']:9.1f} {r['t_train']:8.1f} {r.get('t_sleep', 0):7.2f} {r['t_sync']:7.2f} {r['gen_tok_s']:9.0f} {r['train_tok_s']:11.0f} {fwd:8d} "
          f"{r.get('peak_mem_gb', 0):8.1f} {mfu:>6} {corr:>9} {r['dlogp_mean']:8.4f}")
EOF
