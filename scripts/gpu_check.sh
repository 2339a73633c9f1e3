#!/usr/bin/env bash
# relayrl's GPU smoke check: every GPU path of the project on one node that has torch with CUDA but no network, run
# from a source tree (no pip install of the project). On a node, with the wheels the image lacks packed beside the
# checkout (../shared/gpu/pack.sh writes .gpu/):
#     bash .gpu/run.sh bash scripts/gpu_check.sh
# and anywhere, as a dry run on a CPU (tiny shapes, short budgets; tests/test_gpu_check.py runs it):
#     bash scripts/gpu_check.sh --device cpu
#
# Steps, each under its own `timeout` (capped by what is left of TOTAL_S), one verdict line each:
#   env           versions, the GPU, and an import of every project module (optional packages missing: said, no fail)
#   optional      vllm, sglang, flashinfer: importable, or SKIP and why (their gpu tests then skip in gpu-tests)
#   gpu-tests     pytest -m gpu over the test files that have gpu tests (two-GPU ones skip on one GPU, saying why); the
#                 summary lists every test with its outcome, and the step FAILs on CUDA when one of issue 34's (the
#                 engine on a real GPU: ISSUE34_TESTS below) did not pass (skipped counts as not run)
#   engine-bench  bench/engine_gpu.py: the native engine against transformers and a launch-free floor at batch 1, 16,
#                 64 and 256, each CUDA graph bucket's capture time and memory (SKIP if absent)
#   logprob-mismatch  bench/logprob_mismatch.py on the device: the engine's logprobs against a float32 reference in
#                 float32 (the default before issue 34), bfloat16 (the default on an accelerator since) and bfloat16
#                 with the float32 LM head, from a float32 checkpoint
#   trainer-step  bench/trainer_gpu_step.py: a GRPO step at Qwen2.5-0.5B's shape against a plain torch step
#   quickstart    the quickstart experiment (its project written into WORK by deploy/experiment/quickstart.py, its
#                 deploy/experiment/quickstart_experiment.yaml run as `relayrl run FILE`) with the rollout engine and the trainer
#                 on the device, QS_RL_S seconds of RL after its SFT warm-up; PASS when held-out accuracy rose
# A verdict line reads "verdict: NAME PASS|FAIL|SKIP (why)"; the last line "summary: ...". Exit status 1 when a step
# failed. Full output of each step in $OUT/NAME.log, the verdicts and result lines in $OUT/summary.txt.
#
# Options: --device cuda|cpu (default cuda; cpu = the dry run), -h.
# Env: OUT (logs; default a new /tmp/relayrl-gpu-check.*), TOTAL_S (wall budget of all steps; default 520: with the
#      wheels' install, under the 10 minutes a device command may run), PY (python; default python3), WORK (scratch:
#      models, the quickstart's run; default a temp dir, removed), ENGINE_ARGS (more arguments of bench/engine_gpu.py,
#      after the defaults: --repeats 1 on cuda, --quick on cpu), QS_RL_S (default 60 on cuda, 30 on cpu), QS_SFT_STEPS.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

DEVICE=cuda
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="${2:-}"; shift 2 ;;
    --device=*) DEVICE="${1#--device=}"; shift ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu_check.sh: --device is cuda or cpu, got '$DEVICE'" >&2; exit 2 ;; esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
case ":${PYTHONPATH:-}:" in *":$ROOT:"*) ;; *) export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT" ;; esac
PY="${PY:-python3}"
TOTAL_S="${TOTAL_S:-520}"
OUT="${OUT:-$(mktemp -d /tmp/relayrl-gpu-check.XXXXXX)}"
if [ -z "${WORK:-}" ]; then  # scratch of ours: removed at the end
  WORK="$(mktemp -d /tmp/relayrl-gpu-work.XXXXXX)"
  trap 'rm -rf "$WORK"' EXIT
fi
mkdir -p "$OUT" "$WORK"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
T0=$(date +%s)
PASSED=0 FAILED=0 SKIPPED=0
if [ "$DEVICE" = cpu ]; then DRY=1; else DRY=0; fi

say() { echo "$*" | tee -a "$SUMMARY"; }
note() { if [ $# -gt 0 ]; then printf '%s\n' "$*"; else cat; fi | sed 's/^/   /' | tee -a "$SUMMARY"; }  # args or stdin
left() { echo $(( TOTAL_S - ($(date +%s) - T0) )); }

# verdict NAME PASS|FAIL|SKIP WHY: the step's one line
verdict() {
  case "$2" in PASS) PASSED=$((PASSED + 1)) ;; FAIL) FAILED=$((FAILED + 1)) ;; *) SKIPPED=$((SKIPPED + 1)) ;; esac
  say "verdict: $1 $2 ($3)"
}

# run NAME BUDGET_S CMD...: CMD under `timeout min(BUDGET_S, what is left)`, its output in $OUT/NAME.log; sets RC
# (124 = timed out) and LOG. Returns 1 (RC 125) without running when under 20 s are left.
run() {
  local name="$1" budget="$2"; shift 2
  local rem; rem=$(left)
  LOG="$OUT/$name.log"
  if [ "$rem" -lt 20 ]; then RC=125; return 1; fi
  [ "$budget" -gt "$rem" ] && budget=$rem
  echo "== $name (timeout ${budget}s, t=$(( $(date +%s) - T0 ))s): $*"
  { echo "## $name: $*"; echo "## timeout ${budget}s"; } > "$LOG"
  STARTED=$(date +%s)
  timeout -k 10 "$budget" "$@" >> "$LOG" 2>&1 < /dev/null
  RC=$?
  [ "$RC" -eq 137 ] && RC=124
  return 0
}

took() { echo "$(( $(date +%s) - STARTED ))s"; }
no_time() { verdict "$1" SKIP "only $(left)s of TOTAL_S=${TOTAL_S}s left"; }
timed_out() { verdict "$1" FAIL "timed out after $(took)"; tail -n 8 "$LOG" | note; }
failed() { verdict "$1" FAIL "exit $RC after $(took): $(grep -E 'Error|error|FAIL' "$LOG" | tail -n 1 | cut -c1-160)"
           tail -n 12 "$LOG" | note; }
results() { grep -E '^result:' "$LOG" | note; }

say "relayrl GPU check: device $DEVICE$([ $DRY = 1 ] && echo ' (dry run)'), host $(uname -n), $(date -u +%FT%TZ), \
TOTAL_S ${TOTAL_S}s, logs in $OUT"

# ---------------------------------------------------------------- env
cat > "$WORK/env_check.py" <<'PYEOF'
import importlib, pkgutil, sys
import torch
device = sys.argv[1]
print(f"python {sys.version.split()[0]}; torch {torch.__version__}; cuda {torch.version.cuda}; "
      f"cuda available {torch.cuda.is_available()}; devices {torch.cuda.device_count()}")
if torch.cuda.is_available():
    print(f"gpu {torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}, "
          f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB, nccl {torch.cuda.nccl.version()}")
OPTIONAL = {"ray", "vllm", "sglang", "flashinfer", "cupy", "kubernetes", "datasets", "pyarrow", "trl"}
broken, optional, count = [], [], 0
for top in ("protos", "services", "rollout", "reward", "trainer", "deploy"):
    for info in pkgutil.walk_packages(importlib.import_module(top).__path__, top + "."):
        if info.name.endswith("__main__"):
            continue
        count += 1
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            (optional if (exc.name or "").split(".")[0] in OPTIONAL else broken).append(f"{info.name}: {exc}")
        except Exception as exc:  # noqa: BLE001 - reported, then the verdict
            broken.append(f"{info.name}: {type(exc).__name__}: {exc}")
for line in optional:
    print(f"optional missing: {line}")
for line in broken:
    print(f"IMPORT FAIL {line}")
print(f"imports: {count - len(broken) - len(optional)} of {count} modules, {len(optional)} need an optional package, "
      f"{len(broken)} broken")
if device == "cuda" and not torch.cuda.is_available():
    print("FAIL torch sees no CUDA device")
    sys.exit(1)
sys.exit(1 if broken else 0)
PYEOF
if run env 90 "$PY" "$WORK/env_check.py" "$DEVICE"; then
  { command -v nvidia-smi > /dev/null && nvidia-smi -L; } >> "$LOG" 2>&1
  if [ "$RC" -eq 0 ]; then
    verdict env PASS "$(grep -E '^imports:' "$LOG" | cut -c10-); $(grep -E '^(gpu|python) ' "$LOG" | tail -n 1 | cut -c1-110)"
  elif [ "$RC" -eq 124 ]; then timed_out env
  else failed env; fi
  grep -E '^(python|gpu|optional missing|IMPORT FAIL|FAIL)' "$LOG" | note
else no_time env; fi

# ---------------------------------------------------------------- optional packages
for pkg in vllm sglang flashinfer; do
  if run "optional-$pkg" 90 "$PY" -c "import $pkg, sys; print('$pkg', getattr($pkg, '__version__', '?'))"; then
    if [ "$RC" -eq 0 ]; then
      verdict "$pkg" PASS "$(tail -n 1 "$LOG" | cut -c1-80) importable: its gpu tests run in gpu-tests"
    else
      verdict "$pkg" SKIP "not importable ($(grep -E 'Error' "$LOG" | tail -n 1 | cut -c1-100)): its gpu tests skip"
    fi
  else no_time "$pkg"; fi
done

# ---------------------------------------------------------------- gpu-tests
# Issue 34's gpu tests (the native engine's CUDA paths) and issue 35's fused-MoE kernel: on CUDA each must pass, not skip.
ISSUE34_TESTS=(
  "tests/test_engine_cuda_graphs.py::test_replayed_decode_equals_the_eager_kernel_and_survives_a_changed_update"
  "tests/test_engine_cuda_graphs.py::test_bfloat16_by_default_on_cuda_the_kernel_and_graphs_follow_the_torch_path"
  "tests/test_engine_attention_triton.py::test_on_cuda_the_compiled_kernel_equals_the_torch_path_in_bfloat16_and_split"
  "tests/test_engine_host_sync.py::test_on_cuda_a_whole_step_synchronizes_once"
  "tests/test_engine_host_sync.py::test_on_cuda_a_step_forward_does_not_synchronize"
  "tests/test_engine_moe_triton.py::test_on_cuda_the_compiled_moe_kernels_equal_the_torch_experts"  # issue 35
)
mapfile -t GPU_FILES < <(grep -l "pytest.mark.gpu" tests/test_*.py | sort)
PYTEST_OPTS=(-q -rA -m gpu -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml")
"$PY" -c "import pytest_timeout" 2> /dev/null && PYTEST_OPTS+=(--timeout 120)
# pytest-asyncio 1.x needs pytest >= 8.4; without it the (synchronous) gpu tests still run
"$PY" -c "import pytest, pytest_asyncio, sys; sys.exit(tuple(int(x) for x in pytest.__version__.split('.')[:2]) < (8, 4))" \
  2> /dev/null || PYTEST_OPTS+=(-p no:asyncio)
# Each test of the JUnit report as "OUTCOME file::name[ (why)]", outcome PASS, FAIL or SKIP.
outcomes() {
  "$PY" - "$OUT/gpu-tests.xml" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    module, name = case.get("classname") or case.get("name"), case.get("name") if case.get("classname") else "*"
    path = module.replace(".", "/") + ".py"  # a module skipped at collection (an optional package) is one case
    found = [child for child in case if child.tag in ("failure", "error", "skipped")]
    outcome = {"failure": "FAIL", "error": "FAIL", "skipped": "SKIP"}.get(found[0].tag, "") if found else "PASS"
    why = f" ({(found[0].get('message') or '')[:90]})" if found else ""
    print(f"{outcome} {path}::{name}{why}")
PYEOF
}
if run gpu-tests 240 "$PY" -m pytest "${PYTEST_OPTS[@]}" "${GPU_FILES[@]}"; then
  counts=$(grep -E '(passed|failed|skipped|error|no tests ran)' "$LOG" | grep -E ' in [0-9.]+s' | tail -n 1 | tr -d '=' | sed 's/^ *//; s/ *$//')
  n_passed=$(grep -oE '[0-9]+ passed' <<< "$counts" | cut -d' ' -f1); n_passed=${n_passed:-0}
  listed=$([ -f "$OUT/gpu-tests.xml" ] && outcomes 2>> "$LOG")
  not_run=()
  for test in "${ISSUE34_TESTS[@]}"; do grep -qF "PASS $test" <<< "$listed" || not_run+=("${test##*::}"); done
  if [ "$RC" -eq 124 ]; then timed_out gpu-tests
  elif [ "$RC" -eq 0 ] && [ "$n_passed" -gt 0 ] && [ $DRY = 0 ] && [ ${#not_run[@]} -gt 0 ]; then
    verdict gpu-tests FAIL "$counts, but issue 34's did not all pass: ${not_run[*]}"
  elif [ "$RC" -eq 0 ] && [ "$n_passed" -gt 0 ]; then verdict gpu-tests PASS "$counts; ${#GPU_FILES[@]} files"
  elif [ "$RC" -eq 0 ] || [ "$RC" -eq 5 ]; then
    verdict gpu-tests SKIP "no gpu test ran: ${counts:-none collected}; mostly: $(grep -E '^SKIPPED' "$LOG" \
      | sed 's/^[^:]*:[0-9]*: //' | sort | uniq -c | sort -rn | head -n 1 | sed 's/^ *[0-9]* //' | cut -c1-80)"
  else verdict gpu-tests FAIL "exit $RC: $counts"; fi
  grep -E '^(FAILED|ERROR)' "$LOG" | head -n 20 | note
  if [ -n "$listed" ]; then sort <<< "$listed" | note
  else grep -E '^SKIPPED' "$LOG" | sed 's/^SKIPPED \[[0-9]*\] //' | head -n 30 | note; fi
else no_time gpu-tests; fi

# ---------------------------------------------------------------- engine-bench
if [ ! -f bench/engine_gpu.py ]; then
  verdict engine-bench SKIP "bench/engine_gpu.py is not in this tree"
else
  # shellcheck disable=SC2086
  if run engine-bench 180 "$PY" bench/engine_gpu.py --device "$DEVICE" $([ $DRY = 1 ] && echo --quick || echo --repeats 1) \
      ${ENGINE_ARGS:-}; then
    if [ "$RC" -eq 0 ]; then verdict engine-bench PASS "$(grep -c '^result:' "$LOG") result lines in $(took)"
    elif [ "$RC" -eq 124 ]; then timed_out engine-bench
    else failed engine-bench; fi
    grep -E '^CUDA graph captures' "$LOG" | note
    results
  else no_time engine-bench; fi
fi

# ---------------------------------------------------------------- logprob-mismatch
# shellcheck disable=SC2046
if run logprob-mismatch 90 "$PY" bench/logprob_mismatch.py --device "$DEVICE" --quick --checkpoint-dtype float32 \
    $([ $DRY = 1 ] && echo --shape small); then
  if [ "$RC" -eq 0 ]; then
    verdict logprob-mismatch PASS "$(grep -E '^result: bf16_default_abs_mean' "$LOG" | cut -d'(' -f1 | cut -c9- | sed 's/ *$//') in $(took)"
  elif [ "$RC" -eq 124 ]; then timed_out logprob-mismatch
  else failed logprob-mismatch; fi
  grep -A3 -E '^ +engine +tokens' "$LOG" | note
  results
else no_time logprob-mismatch; fi

# ---------------------------------------------------------------- trainer-step
# shellcheck disable=SC2046
if run trainer-step 120 "$PY" bench/trainer_gpu_step.py --device "$DEVICE" $([ $DRY = 1 ] && echo --quick) \
    --model-dir "$WORK/trainer-model"; then
  if [ "$RC" -eq 0 ]; then
    verdict trainer-step PASS "$(grep -E '^result: trainer_step_vs_plain_torch' "$LOG" | cut -d'(' -f1 | cut -c9- | sed 's/ *$//') in $(took)"
  elif [ "$RC" -eq 124 ]; then timed_out trainer-step
  else failed trainer-step; fi
  results
else no_time trainer-step; fi

# ---------------------------------------------------------------- quickstart
if [ $DRY = 1 ]; then QS_RL_S="${QS_RL_S:-30}"; QS_SFT_STEPS="${QS_SFT_STEPS:-30}"; QS_EVAL_S=10
else QS_RL_S="${QS_RL_S:-60}"; QS_SFT_STEPS="${QS_SFT_STEPS:-450}"; QS_EVAL_S=15; fi
QS_NEEDS=$(( QS_RL_S + 60 ))  # start-up, the SFT warm-up (on the CPU) and the final evaluation come on top
QS_BUDGET=$(( QS_RL_S + 180 ))
cat > "$WORK/quickstart.py" <<'PYEOF'
# The quickstart's project (deploy/experiment/quickstart.py: the tiny model, the addition data, the shipped experiment
# file) written into argv[1], then that file run as `relayrl run FILE --set ...` runs it (argv[2:]: the --set's).
import pathlib, sys
from deploy.cli import main
from deploy.experiment.quickstart import write_project
sys.exit(main(["run", str(write_project(pathlib.Path(sys.argv[1]))), *sys.argv[2:]]))
PYEOF
# Exit 0: held-out accuracy rose; 3: it did not (the result line printed either way); 1: no step was taken.
quickstart_report() {
  "$PY" - "$WORK/qs/summary.json" <<'PYEOF'
import json, sys
s = json.load(open(sys.argv[1]))
restarts = sum(s["restarts"].values()) if isinstance(s["restarts"], dict) else s["restarts"]
if not s["steps"]:
    print(f"no optimizer step in {s['rl_seconds']:.0f}s of RL ({s['completions']} completions)")
    sys.exit(1)
print(f"result: quickstart_held_out = {s['sft_accuracy']:.3f} -> {s['final_accuracy']:.3f} (best {s['best_accuracy']:.3f}; "
      f"{s['steps']} steps, {s['completions']} completions in {s['rl_seconds']:.0f}s of RL, restarts {restarts})")
sys.exit(0 if s["final_accuracy"] > s["sft_accuracy"] else 3)
PYEOF
}
if [ "$(left)" -lt "$QS_NEEDS" ]; then
  verdict quickstart SKIP "only $(left)s left, it needs ${QS_NEEDS}s"
else
  rm -rf "$WORK/qs"; held_out=""; report=1
  run quickstart "$QS_BUDGET" "$PY" "$WORK/quickstart.py" "$WORK/qs-project" --set "run_dir=$WORK/qs" \
    --set "sft.steps=$QS_SFT_STEPS" --set "training.time_budget_s=$QS_RL_S" --set "evaluation.every_s=$QS_EVAL_S" \
    --set "services.rollout.settings={engine.device: $DEVICE}"
  if [ "$RC" -eq 0 ]; then held_out=$(quickstart_report 2>> "$LOG"); report=$?; fi
  [ -n "$held_out" ] && printf '\n%s\n' "$held_out" >> "$LOG"
  for f in "$WORK"/qs/logs/*.log; do [ -f "$f" ] && { echo "---- tail $f"; tail -n 15 "$f"; } >> "$LOG"; done
  figures=$(sed 's/^result: quickstart_held_out = //' <<< "$held_out")
  if [ "$RC" -eq 124 ]; then timed_out quickstart
  elif [ "$RC" -ne 0 ]; then failed quickstart
  elif [ "$report" -eq 0 ]; then verdict quickstart PASS "held-out accuracy rose on $DEVICE: $figures"
  elif [ "$report" -eq 3 ] && [ $DRY = 1 ]; then
    verdict quickstart PASS "dry run: the run ended, no held-out gain in ${QS_RL_S}s of RL on a CPU: $figures"
  elif [ "$report" -eq 3 ]; then verdict quickstart FAIL "no held-out gain on $DEVICE: $figures"
  elif [ -n "$held_out" ]; then verdict quickstart FAIL "$held_out"
  else verdict quickstart FAIL "no summary after exit 0: $(tail -n 1 "$LOG" | cut -c1-160)"; fi
  [ "$report" -ne 1 ] && note "$held_out"
fi

say "summary: $PASSED PASS, $FAILED FAIL, $SKIPPED SKIP in $(( $(date +%s) - T0 ))s (device $DEVICE; logs in $OUT)"
[ "$FAILED" -eq 0 ]
