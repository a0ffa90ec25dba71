#!/usr/bin/env bash
# One batched GPU session on a lent H200: install carried wheels, install simtree without
# deps, then run the named parts (gdn, tune, v4, profile, ncu, lossless, refresh), each bounded, each
# writing under $OUT.
# Usage (on the GPU machine): bash scripts/gpu_session.sh gdn v4 profile   (gdn: GDN_RESUME=DIR
# finishes the cut benchmark in DIR, GDN_RETIME="16:128,64:128" times those of its finished
# shapes again, TREE_CONFIGS its extra tree configs; tune: TUNE_ARGS=...,
# v4: V4_ARGS=..., e.g. "--plan-switches 60"; profile: PROFILE_RESUME=simtree/data/profiles/h200 to add
# to the committed profile, PROFILE_ARGS="--model qwen3.6-27b" to restrict it, and with
# "--only-stage gdn_tree_commit --remeasure" to time that stage again after a kernel change;
# ncu: NCU_SHAPES="16:128 64:128"; lossless: every speculative mode checked, LOSSLESS_LIMIT s;
# refresh: the GDN benchmark and the profile's GDN verify rows after a launch-rule change;
# gputest: the tests marked gpu, GPUTEST_TIMEOUT s, GPUTEST_FILES the test files to collect,
# e.g. tests/test_gdn_cuda_walk.py where the carried wheels lack what other files import)
set -uo pipefail
OUT=${OUT:-/tmp/out}
RES=/tmp/simtree_results   # many files; tarred into $OUT at the end ($OUT returns <= 8 files)
mkdir -p "$OUT" "$RES"
source "$(dirname "$0")/gpu_install.sh"
gpu_install
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$RES/gpu_state.csv"
bench_gdn() {   # bench_gdn TIMEOUT MAX_SECONDS TREE_CONFIGS [args]: the GDN benchmark into $RES/gdn
  timeout "$1" python3 -m simtree.profiler.bench.bench_gdn --out "$RES/gdn" --max-seconds "$2" \
      --tree-configs "$3" "${@:4}" 2>&1 | tee "$RES/gdn.log" | tail -60
}
seed_profile() {   # seed_profile DIR: start $RES/h200 from a committed profile (DIR)
  mkdir -p "$RES/h200" && cp "$1"/profile.csv "$1"/profile.meta.json "$RES/h200/" &&
      { cp "$1"/profile.points.jsonl "$RES/h200/" 2>/dev/null || true; }   # the sweep log, where kept
}
sweep() {   # sweep TIMEOUT MAX_MINUTES [args]: the profile sweep into $RES/h200/profile.csv
  timeout -k 10 "$1" python3 -m simtree.profiler.sweep --sweep "${SWEEP:-scenarios/sweeps/default_gpu.yaml}" \
      --out "$RES/h200/profile.csv" --max-minutes "$2" --no-progress "${@:3}" 2>&1 | tee -a "$RES/profile.log" | tail -c 6000
}
failed=()
for part in "$@"; do
  echo "=== $part $(date +%T)"
  case "$part" in
    gdn)
      # GDN_RESUME=DIR: finish a cut benchmark (DIR holds its bench_gdn.csv / .json /
      # fla_recurrent.jsonl): the shapes it finished are kept, the rest timed
      resume=()
      if [ -n "${GDN_RESUME:-}" ]; then
        mkdir -p "$RES/gdn"
        cp "$GDN_RESUME"/bench_gdn.csv "$GDN_RESUME"/bench_gdn.json "$RES/gdn/" && resume=(--resume)
        [ -n "${GDN_RETIME:-}" ] && resume+=(--retime "$GDN_RETIME")
        cp "$GDN_RESUME"/fla_recurrent.jsonl "$RES/gdn/" 2>/dev/null || true
      fi
      bench_gdn "${GDN_TIMEOUT:-280}" "${GDN_SECONDS:-200}" "${TREE_CONFIGS:-q0,q1}" ${resume[@]+"${resume[@]}"} ;;
    tune) timeout ${TUNE_TIMEOUT:-480} python3 -m simtree.profiler.bench.tune_gdn --out "$RES/tune" ${TUNE_ARGS:-} 2>&1 | tee "$RES/tune.log" | tail -c 9000 ;;
    v4) timeout ${V4_TIMEOUT:-300} python3 -m simtree.profiler.bench.bench_v4 --out "$RES/v4" --max-seconds ${V4_SECONDS:-200} ${V4_ARGS:-} 2>&1 | tee "$RES/v4.log" | tail -60 ;;
    profile)
      # PROFILE_RESUME=DIR: start from a committed profile (e.g. simtree/data/profiles/h200) so the
      # sweep measures only the points it lacks (new stages, deleted rows) and keeps the rest
      if [ -n "${PROFILE_RESUME:-}" ]; then seed_profile "$PROFILE_RESUME"; fi
      sweep "${PROFILE_TIMEOUT:-470}" "${PROFILE_MINUTES:-6}" ${PROFILE_ARGS:-} ;;
    ncu)   # Nsight Compute on the GDN verify (NCU_SHAPES, default four shapes) + its summary
      bash scripts/ncu_gdn.sh "$RES/ncu" ${NCU_SHAPES:+"$NCU_SHAPES"} && python3 scripts/ncu_summary.py "$RES/ncu" > "$RES/ncu/summary.md"
      rm -f "$RES/ncu/"*.ncu-rep; tail -c 3000 "$RES/ncu/summary.md" ;;
    refresh)   # after a GDN launch-rule change: the GDN benchmark (TREE_CONFIGS: extra tree
      # configs) and the profile's Qwen3.6-27B gdn_tree_verify rows re-measured on the committed
      # profile (a second sweep finishes what the stage budget cut); then, at home: report_gdn,
      # copy the profile files, scripts/ship_defaults.sh
      bench_gdn "${GDN_TIMEOUT:-300}" "${GDN_SECONDS:-220}" "${TREE_CONFIGS:-q0,q1,k0}"
      seed_profile simtree/data/profiles/h200
      for again in --remeasure ""; do
        sweep 200 3 --model qwen3.6-27b --only-stage gdn_tree_verify $again
      done ;;
    lossless) LIMIT=${LOSSLESS_LIMIT:-280} bash scripts/lossless_gpu.sh "$RES/lossless" && grep "^|" "$RES/lossless/README.md" ;;
    gputest)   # the tests marked gpu (e.g. the CUDA walk against the Triton walk and the reference)
      timeout ${GPUTEST_TIMEOUT:-300} python3 -m pytest -q -m gpu ${GPUTEST_FILES:-tests} 2>&1 | tee "$RES/gputest.log" | tail -30 ;;
    *) echo "unknown part $part"; false ;;
  esac
  rc=$?   # pipefail: the benchmark's own exit status (124 = timed out), not tee's
  [ $rc -eq 0 ] || { echo "=== $part FAILED (exit $rc): its results may be partial"; failed+=("$part"); }
done
tar czf "$OUT/results.tgz" -C "$RES" .
ls -la "$OUT"
[ ${#failed[@]} -eq 0 ] || { echo "failed parts: ${failed[*]}"; exit 1; }
