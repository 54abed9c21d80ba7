#!/usr/bin/env bash
# The engine matrix on GPUs (NCCL): precision {fp32, bf16, fp16} x ZeRO stage
# {1, 2, 3} (STAGES) x optimizer {on the GPU, offloaded to the CPU; at stage 3 the
# parameters too, and every block gathered and freed per use}, each run as
#   base:   8 steps at W ranks (W = 4, or the most GPUs there are), checkpoint at 4
#   same:   resume global_step4 at W ranks -> steps 5..8 must equal base's bit for bit
#           (loss, lr, grad_norm, loss_scale)
#   univ:   uckpt convert global_step4, resume at W/2 ranks -> losses within TOL of base
#   resh:   resume global_step4's ZeRO files at W/2 ranks, not converted -> within TOL
#   switch: (stages 2 and 3) the same at the other of the two stages -> within TOL
#   overlap: (stage 3, small buckets) overlap_comm on with prefetching off against
#           overlap_comm off with prefetching on -> steps 1..8 equal bit for bit
# plus, per precision, the same 8 steps at 1 and 2 ranks (stage 2; batch 16 = micro 4 x
# GA 4/2/1) against the W-rank base, and fp16's dynamic loss scale: a skipped step has
# grad_norm -1, halves the scale (hysteresis 1), keeps the lr; the others keep the scale.
# fp16 starts at scale 2^24, where step 1's logit gradients overflow (4 x 63 positions
# per micro-batch: 2^24/252 > 65504), so the skip path runs; the world-size sweep
# starts fp16 at 2^12 (no overflow) because GA changes where overflows happen.
# Prints a PASS/FAIL table; exit 1 if any row fails.
#
# usage: tests/engine/gpu_matrix.sh UCKPT [OUT_DIR]
#   DEVICE=cpu runs it on Gloo (fp32/bf16 only; offload is then a no-op) to test the script.
set -uo pipefail
uckpt=$(realpath "${1:?usage: tests/engine/gpu_matrix.sh UCKPT [OUT_DIR]}")
out=$(realpath -m "${2:-gpu-matrix-out}")
device=${DEVICE:-cuda}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "$device" = cuda ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  precisions=${PRECISIONS:-"fp32 bf16 fp16"}
else
  gpus=${CPU_RANKS:-4}
  precisions=${PRECISIONS:-"fp32 bf16"}
fi
[ "$gpus" -ge 2 ] || { echo "gpu_matrix: needs at least 2 GPUs (found $gpus)" >&2; exit 2; }
W=$(( gpus >= 4 ? 4 : 2 )); H=$(( W / 2 ))
rm -rf "$out" && mkdir -p "$out" && cd "$out"
model="--n_layer 2 --n_head 4 --n_embd 64 --vocab_size 512 --n_positions 64 --seq_len 64"

config() {  # config FILE PRECISION STAGE OFFLOAD SCALE_POWER [ZERO_EXTRA_JSON]
  local fp16=false bf16=false off=none z3=""
  [ "$2" = fp16 ] && fp16=true
  [ "$2" = bf16 ] && bf16=true
  [ "$4" = cpu ] && off=cpu
  [ "$3" = 3 ] && z3=", \"stage3_param_persistence_threshold\": 0, \"offload_param\": {\"device\": \"$off\"}${6:-}"
  cat > "$1" <<JSON
{
  "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "steps_per_print": 0,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 3,
                                               "warmup_type": "linear"}},
  "fp16": {"enabled": $fp16, "loss_scale": 0, "initial_scale_power": $5, "loss_scale_window": 1000,
           "hysteresis": 1, "min_loss_scale": 1},
  "bf16": {"enabled": $bf16},
  "zero_optimization": {"stage": $3, "offload_optimizer": {"device": "$off"}$z3}
}
JSON
}

train() {  # train NRANKS RUN_NAME CONFIG [extra flags...]; a failed run is a FAIL row
  local n=$1 name=$2 cfg=$3; shift 3
  "$uckpt" launch -n "$n" --master_port 0 -- "$uckpt" train --config "$cfg" $model --device "$device" \
    --log_dir logs --run_name "$name" --no_progress --timeout 120 "$@" > "logs-$name.txt" 2>&1 && return 0
  echo "  $name failed:"; grep -v "^frame #" "logs-$name.txt" | tail -12
  rows+=("$(printf '%-34s FAIL run failed: %s' "$name" "$(grep -m1 -E 'error|exited|Segmentation' "logs-$name.txt")")")
  return 1
}

rows=()
check() {  # check LABEL KIND ARGS... -> appends a table row
  local label=$1; shift
  local res
  res=$(python3 - "$@" <<'PY'
import csv, math, sys
kind = sys.argv[1]
def read(run):
    try:
        return {int(r["step"]): r for r in csv.DictReader(open(f"logs/{run}/metrics.csv"))}
    except FileNotFoundError:
        return None
if kind == "same":  # same BASE RESUMED: every column of the resumed steps equal
    a, b = read(sys.argv[2]), read(sys.argv[3])
    if not a or not b: print("FAIL no metrics"); sys.exit()
    bad = [s for s in b if any(a[s][k] != b[s][k] for k in ("loss", "lr", "grad_norm", "loss_scale"))]
    print(f"{'FAIL' if bad or len(b) < 4 else 'PASS'} steps {min(b)}..{max(b)} bit-equal" + (f", differs at {bad[0]}" if bad else ""))
elif kind == "close":  # close BASE OTHER RTOL: losses of OTHER's steps within RTOL of BASE
    a, b, tol = read(sys.argv[2]), read(sys.argv[3]), float(sys.argv[4])
    if not a or not b: print("FAIL no metrics"); sys.exit()
    rel = max(abs(float(b[s]["loss"]) - float(a[s]["loss"])) / abs(float(a[s]["loss"])) for s in b)
    ok = rel < tol and all(math.isfinite(float(b[s]["loss"])) for s in b) and len(b) >= 4
    print(f"{'PASS' if ok else 'FAIL'} steps {min(b)}..{max(b)} max rel {rel:.2g} (limit {tol:g})")
elif kind == "scale":  # scale RUN: DeepSpeed's dynamic loss scaling, hysteresis 1, window > steps
    a = read(sys.argv[2])
    if not a: print("FAIL no metrics"); sys.exit()
    steps, problems, skipped = sorted(a), [], 0
    for i, s in enumerate(steps):
        r = a[s]; sc = float(r["loss_scale"]); skip = float(r["grad_norm"]) == -1
        skipped += skip
        if sc <= 0 or math.log2(sc) != int(math.log2(sc)): problems.append(f"step {s} scale {sc} not a power of 2")
        if i + 1 < len(steps):
            n = a[steps[i + 1]]
            want = sc / 2 if skip else sc
            if float(n["loss_scale"]) != want: problems.append(f"step {steps[i+1]} scale {n['loss_scale']}, expected {want}")
            if skip and n["lr"] != r["lr"]: problems.append(f"lr moved after skipped step {s}")
        if not math.isfinite(float(r["loss"])): problems.append(f"step {s} loss {r['loss']}")
    trained = len(steps) - skipped
    ok = not problems and skipped >= 1 and trained >= 1
    print(f"{'PASS' if ok else 'FAIL'} {skipped} skipped, scale {a[steps[0]]['loss_scale']} -> {a[steps[-1]]['loss_scale']}, "
          f"loss {float(a[steps[0]]['loss']):.4f} -> {float(a[steps[-1]]['loss']):.4f}" + (f"; {problems[0]}" if problems else ""))
PY
)
  rows+=("$(printf '%-34s %s' "$label" "$res")")
  echo "$(printf '%-34s %s' "$label" "$res")"
}

t_start=$SECONDS
for p in $precisions; do
  tol=1e-5; [ "$p" != fp32 ] && tol=2e-2
  for stage in ${STAGES:-1 2 3}; do
    for off in gpu cpu; do
      id=$p-z$stage-$off
      config "cfg-$id.json" "$p" "$stage" "$off" 24
      # Each resumed run saves into a folder of its own (a copy of global_step4, or the
      # converted universal folder), as a user resuming elsewhere would.
      ck=ck-$id
      if train $W "$id-base" "cfg-$id.json" --steps 8 --checkpoint_dir "$ck" --checkpoint_interval 4; then
        [ "$p" = fp16 ] && check "$id: loss scale ($W GPUs)" scale "$id-base"
        if [ "$stage" = 3 ]; then
          config "cfg-$id-ovl.json" "$p" 3 "$off" 24 \
            ', "overlap_comm": true, "reduce_bucket_size": 20000, "stage3_prefetch_bucket_size": 0'
          config "cfg-$id-sync.json" "$p" 3 "$off" 24 ', "reduce_bucket_size": 20000'
          train $W "$id-ovl" "cfg-$id-ovl.json" --steps 8 && train $W "$id-sync" "cfg-$id-sync.json" --steps 8 &&
            check "$id: overlap_comm+no prefetch = sync" same "$id-sync" "$id-ovl"
        fi
        mkdir -p "$ck-same" && cp -r "$ck/global_step4" "$ck-same/" && echo global_step4 > "$ck-same/latest"
        train $W "$id-same" "cfg-$id.json" --steps 8 --checkpoint_dir "$ck-same" --resume &&
          check "$id: resume $W->$W (ZeRO files)" same "$id-base" "$id-same"
        if "$uckpt" convert -q "$ck/global_step4" "$ck-univ/global_step4_universal" > "logs-$id-convert.txt" 2>&1; then
          train $H "$id-univ" "cfg-$id.json" --steps 8 --checkpoint_dir "$ck-univ" --resume --universal_checkpoint &&
            check "$id: resume $W->$H (universal)" close "$id-base" "$id-univ" "$tol"
        else
          rows+=("$(printf '%-34s FAIL convert: %s' "$id: convert" "$(tail -1 "logs-$id-convert.txt")")")
        fi
        mkdir -p "$ck-resh" && cp -r "$ck/global_step4" "$ck-resh/" && echo global_step4 > "$ck-resh/latest"
        train $H "$id-resh" "cfg-$id.json" --steps 8 --checkpoint_dir "$ck-resh" --resume &&
          check "$id: resume $W->$H (no convert)" close "$id-base" "$id-resh" "$tol"
        if [ "$stage" = 2 ] || [ "$stage" = 3 ]; then
          other=$(( 5 - stage ))
          config "cfg-$id-switch.json" "$p" "$other" "$off" 24
          rm -rf "$ck-resh" && mkdir -p "$ck-resh" && cp -r "$ck/global_step4" "$ck-resh/" && echo global_step4 > "$ck-resh/latest"
          train $H "$id-switch" "cfg-$id-switch.json" --steps 8 --checkpoint_dir "$ck-resh" --resume &&
            check "$id: $W->$H at stage $other (no convert)" close "$id-base" "$id-switch" "$tol"
        fi
      fi
      rm -rf "$ck" "$ck-same" "$ck-univ" "$ck-resh"
    done
  done
  # World sizes: the same global batches at 1, 2 and W ranks (stage 2, optimizer on GPU).
  config "cfg-$p-sweep.json" "$p" 2 gpu 12
  for n in $W 2 1; do train $n "$p-sweep-w$n" "cfg-$p-sweep.json" --steps 8 || true; done
  for n in 2 1; do
    if [ "$n" -lt "$W" ]; then check "$p-z2: $n vs $W ranks (GA $((4 / n)))" close "$p-sweep-w$W" "$p-sweep-w$n" "$tol"; fi
  done
done

echo
echo "==== gpu_matrix: $device, $gpus devices, W=$W, $(( SECONDS - t_start )) s ===="
printf '%s\n' "${rows[@]}"
fails=$(printf '%s\n' "${rows[@]}" | grep -c ' FAIL' || true)
echo "rows: ${#rows[@]}, failed: $fails"
[ "$fails" -eq 0 ]
