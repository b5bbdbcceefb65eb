#!/usr/bin/env bash
# The whole GPU check in one call (for the device machine): start CUDA MPS, run every
# `cuda`-marked test (multi-process ones included), the main job (tools/smoke.py, 1A1F and
# 2A2F) and the short benchmarks, stop MPS, print a summary table last. Logs go to $OUT
# (or ./gpu_out), packed into one archive.
#
#   bash tools/gpu_suite.sh [MODE]
#
# Modes (each of part1..part3, soak1, moe1, stream1..3, fp8e2e, mps1, trace1, plan1, corun1 and twogpu1..4 fits one 600 s device call):
#   full     every cuda test, the host-polling e2e cases without MPS, both main jobs,
#            hf_generate, the soak, then the benchmarks (default)
#   quick    the cuda tests and both main jobs
#   bench    the benchmarks only (BENCHES)
#   part1    kernels (FP8 dispatch rows too), FFN graph, moe, step graph, e2e errors, window, adapters, expert GEMM
#            tests, both main jobs and hf_generate
#   part2    test_e2e.py
#   part3    model gates, NVSHMEM binding, bench_moe_layer at a small shape, peer loss, faults
#   soak1    one GPU: the fault model's soak (tools/soak.py: random sizes, stages, stalls,
#            every output checked) 2A2F pair and dedup, 1A2F dedup + put, 2A1F pair + put,
#            1A1F pair 8e4 round trips, 1A1F with launch(exit_grace_s=10) (the /dev/shm
#            entries a job leaves)
#   moe1     one GPU: the expert-GEMM cuda tests, then tools/bench_moe_layer.py --quick (one
#            MoE layer in one process vs AFD 1A1F; expert GEMM variants, FP8 weights)
#   stream1  one GPU: the streamed expert GEMMs' cuda tests (Triton), then tools/bench_stream_gemm.py
#            --quick (their tile sweep against torch's grouped GEMM and the weight-read floor)
#   stream2  one GPU: the V2-Lite-shaped MoE step (bench_step_graph --trace) with the graph FFN's
#            expert GEMMs torch's (grouped_mm) and the streamed ones, then bench_moe_layer's AFD
#            layer with the streamed ones (v2lite, qwen3)
#   fp8e2e   one GPU: the FP8 cuda tests of the graph FFN and the FP8 dispatch, then bench_moe_layer's
#            AFD layer (v2lite, v3; 1 and 128 tokens) with the streamed GEMMs in bf16 and FP8 end to
#            end (--dispatch-dtype fp8_e4m3 --ffn-fp8-experts): speed and error against bf16
#   stream3  one GPU: prefill 4096: the streamed kernels with large row tiles (bench_stream_gemm
#            --block-m 64 128) and expert_gemm's padded_bmm against torch's grouped GEMM and
#            the dense rate of the same run
#   mps1     one GPU: tools/bench_kernels.py (pair and dedup, loopback) four ways: no MPS, under MPS,
#            at a 50 % SM share, and at 50 % beside a neighbor process spinning one block
#            (tools/spin_neighbor.py, as an FFN's wait): which of them makes the dispatch slower
#   trace1   one GPU: the 50-layer step's phases against their floors (fused vs two-kernel
#            dispatch and FFN wait + stage; dedup), one stream vs a stream per stage
#            (S = 1 2 4), the V2-Lite-shaped MoE step with the GEMM SM carve-out 0 and
#            "auto", torch's gate against the one-kernel gate, bench_gate
#   kernels1 one GPU, no MPS: tools/bench_kernels.py (the decode round trip's kernels one by one,
#            loopback in one process, against their floors), then Nsight Compute on the same
#            kernels at 128 tokens (KERNELS_CONFIGS, NCU_SECTIONS)
#   plan1    one GPU: the planner's validation runs: bench_afd's skew x split sweep (prefill)
#            and bench_decode's two presets with a timeline (decode)
#   corun1   one GPU: tools/bench_corun.py (decode attention at two contexts and the FFN's expert
#            GEMMs, each alone and together under MPS shares)
#   twogpu1  two GPUs: bench_transport decode + prefill, both wire modes and transports
#   twogpu2  two GPUs: bench_afd with the FFN on its own GPU: overlap, sweep, timeline
#   twogpu3  two GPUs: the multigpu tests, bench_step_graph --trace (pair, dedup),
#            bench_graph_ffn
#   twogpu4  two GPUs: the GEMM SM carve-out (0 vs "auto") with the FFN on its own GPU
#
# part1 / part2 / part3 run pytest-xdist with 4 / 3 / 2 workers unless PYTEST_ARGS says otherwise
# (serially part2 alone takes ~7 minutes); SERIAL_K (a pytest -k expression; part2: mixed_job)
# takes tests out of that step and runs them one at a time after it (SERIAL_TIMEOUT). Do not wrap the script in an outer `timeout`: its
# steps bound themselves with their own process groups, and an outer kill orphans them.
# Knobs (environment): SUITE_TESTS (test files or ids instead of the mode's), SUITE_TIMEOUT,
# TEST_TIMEOUT (per test), PYTEST_ARGS (extra pytest arguments for the cuda tests, e.g. "-n 4"
# with pytest-xdist), SMOKE_ARGS, SKIP_SMOKE_1A1F=1, SKIP_SMOKE_2A2F=1, SKIP_HOSTPOLL=1 /
# HOSTPOLL_TIMEOUT (the e2e cases with host polling and no MPS), SKIP_HF=1
# (tools/hf_generate.py), SKIP_SOAK=1 / SOAK_N / SOAK_TIMEOUT / SOAK_ARGS (tools/soak.py),
# BENCHES (names of tools/*.py run with --quick), BENCH_TIMEOUT, BENCH_ARGS, AFD_COMMIT (the
# commit named in the summary: the device's copy has no usable git HEAD).
# Each pytest step prints its 25 slowest tests (--durations) so that the part split can
# follow them.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NVSHMEM_DISABLE_NCCL=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
export CUDA_MPS_PIPE_DIRECTORY=/tmp/afd_mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/afd_mps_log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
MODE=${1:-full}
# part1 / part2 / part3: the cuda tests in three calls; the knobs still override them.
case "$MODE" in
  part1) SUITE_TESTS=${SUITE_TESTS:-"tests/kernels/test_gate_cuda.py tests/kernels/test_kernels_cuda_dedup_attn.py tests/kernels/test_kernels_cuda_dedup_ffn.py tests/kernels/test_kernels_cuda.py tests/kernels/test_ffn_graph_cuda.py tests/unit/test_moe.py tests/integration/test_step_graph_cuda.py tests/stress/test_e2e_errors.py tests/integration/test_window.py tests/integration/test_adapters.py tests/unit/test_expert_gemm.py tests/integration/test_bench_decode.py tests/kernels/test_kernels_cuda_dedup_ll.py tests/integration/test_ffn_serving.py tests/unit/test_fp8.py tests/kernels/test_fp8_cuda.py tests/integration/test_fp8_dispatch.py tests/kernels/test_stream_gemm_cuda.py"}
         SKIP_HF=${SKIP_HF:-0} SUITE_TIMEOUT=${SUITE_TIMEOUT:-480} PYTEST_ARGS=${PYTEST_ARGS:-"-n 4"} ;;
  part2) SUITE_TESTS=${SUITE_TESTS:-"tests/integration/test_e2e.py tests/integration/test_e2e_dedup_ll.py"}
         SKIP_SMOKE_1A1F=${SKIP_SMOKE_1A1F:-1} SKIP_SMOKE_2A2F=${SKIP_SMOKE_2A2F:-1}
         SUITE_TIMEOUT=${SUITE_TIMEOUT:-550} TEST_TIMEOUT=${TEST_TIMEOUT:-60} PYTEST_ARGS=${PYTEST_ARGS:-"-n 3"}
         SERIAL_K=${SERIAL_K-mixed_job} ;;  # NVSHMEM start-ups of these jobs collide under -n 3
  part3) SUITE_TESTS=${SUITE_TESTS:-"tests/integration/test_gates_e2e.py tests/unit/test_nvshmem_binding.py tests/integration/test_bench_moe_layer.py tests/stress/test_peer_gone.py tests/stress/test_faults.py"}
         SKIP_SMOKE_1A1F=${SKIP_SMOKE_1A1F:-1} SKIP_SMOKE_2A2F=${SKIP_SMOKE_2A2F:-1}
         SUITE_TIMEOUT=${SUITE_TIMEOUT:-550} PYTEST_ARGS=${PYTEST_ARGS:-"-n 2"} ;;
esac
case "$MODE" in part1|part2|part3) SKIP_HOSTPOLL=${SKIP_HOSTPOLL:-1} SKIP_SOAK=${SKIP_SOAK:-1}
                                    SKIP_HF=${SKIP_HF:-1}; MODE=quick ;; esac
SUITE_TIMEOUT=${SUITE_TIMEOUT:-420}

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
nvidia-cuda-mps-control -d && echo "MPS started" || echo "MPS failed to start"
stop_mps() { echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 || true; }
trap stop_mps EXIT

declare -A RESULT
STEP_ORDER=()
restart_mps() {  # a client killed mid-kernel can leave the server refusing new clients
  stop_mps; sleep 1; nvidia-cuda-mps-control -d || echo "MPS failed to restart"
}
run_step() {  # name, timeout, command...   (NO_MPS=1 run_step ...: with MPS stopped)
  local name=$1 limit=$2; shift 2
  if [ "${NO_MPS:-0}" = 1 ]; then stop_mps; sleep 1; else restart_mps; fi
  local start=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local last
  last=$(grep -E 'passed|failed|PASS|FAIL|MISS|Error' "$OUT/$name.log" | tail -1)
  [ -n "$last" ] || last=$(tail -1 "$OUT/$name.log")
  RESULT[$name]="rc=$rc $(( $(date +%s) - start ))s | $(echo "$last" | cut -c1-160)"
  STEP_ORDER+=("$name")
}

# single-process kernel tests first, multi-process end-to-end tests last
# (the fault tests kill processes mid-run, which can leave MPS refusing clients: they go last)
TEST_FILES=${SUITE_TESTS:-}
[ -n "$TEST_FILES" ] || TEST_FILES=$(ls tests/kernels/test_kernels_cuda.py tests/unit/test_moe.py tests/unit/test_nvshmem_binding.py 2>/dev/null; \
  ls tests/*/test_*.py | grep -v -e kernels/test_kernels_cuda.py -e test_moe.py -e test_nvshmem_binding -e test_faults; \
  ls tests/stress/test_faults.py)
case "$MODE" in
  twogpu1)
    BT="python3 tools/bench_transport.py --quick --wire-mode both --transport both"
    run_step bt_decode 240 $BT --ffn 1 2 --tokens 1 32 128 256 --prefill-tokens --out "$OUT/bt_decode"
    run_step bt_prefill_f1 150 $BT --ffn 1 --tokens 1 --prefill-tokens 1024 4096 8192 --nccl-baseline --out "$OUT/bt_prefill_f1"
    run_step bt_prefill_f2 150 $BT --ffn 2 --tokens 1 --prefill-tokens 1024 4096 8192 --out "$OUT/bt_prefill_f2" ;;
  twogpu2)
    AFD="python3 tools/bench_afd.py --quick --attn 2 --ffn 1"
    run_step afd_overlap 220 $AFD --placement 0:50,0:50,1 --overlap all --out "$OUT/afd_overlap"
    run_step afd_sweep 200 $AFD --sweep --sweep-skews 1 4 16 --sweep-placements 0:50,0:50,1 0:30,0:30,1 --out "$OUT/afd_sweep"
    run_step afd_timeline 140 $AFD --placement 0:50,0:50,1 --timeline --workloads skewed --out "$OUT/afd_timeline" ;;
  twogpu3)
    run_step pytest_multigpu 150 python3 -m pytest -m "cuda and multigpu" -q -p no:cacheprovider --timeout=90 -rfEs \
      tests/integration/test_e2e.py tests/stress/test_faults.py
    SG="python3 tools/bench_step_graph.py --quick --num-gpus 2 --layers 1 50 --tokens 32 128 --stages 1 2 --trace"
    run_step step_graph_pair 150 $SG --out "$OUT/step_pair"
    run_step step_graph_dedup 120 $SG --wire-mode dedup --out "$OUT/step_dedup"
    run_step graph_ffn_pair 70 python3 tools/bench_graph_ffn.py --quick --num-gpus 2 --wire-mode pair --out "$OUT/g_pair"
    run_step graph_ffn_dedup 70 python3 tools/bench_graph_ffn.py --quick --num-gpus 2 --wire-mode dedup --out "$OUT/g_dedup" ;;
  twogpu4)  # the GEMM SM carve-out with the FFN on its own GPU: 0 vs "auto", one launch each
    MOE="python3 tools/bench_step_graph.py --quick --num-gpus 2 --layers 10 --tokens 128 --stages 1 --trace --experts moe --hidden 2048 --top-k 6 --intermediate 1408 --shared-experts 2"
    run_step step_moe_c0 100 $MOE --gemm-sm-carveout 0 --out "$OUT/step_moe_c0"
    run_step step_moe_auto 100 $MOE --out "$OUT/step_moe_auto"
    AFD="python3 tools/bench_afd.py --quick --attn 2 --ffn 1 --placement 0:50,0:50,1 --workloads uniform --schedules async --overlap ffn --duration 2 --solo-duration 0"
    run_step afd_ffn_c0 120 $AFD --gemm-sm-carveout 0 --out "$OUT/afd_ffn_c0"
    run_step afd_ffn_auto 120 $AFD --out "$OUT/afd_ffn_auto" ;;
  plan1)  # one GPU, MPS: the runs the planner is validated on (docs/design/planner.md)
    run_step afd_sweep 290 python3 tools/bench_afd.py --quick --attn 2 --ffn 1 --sweep --sweep-skews 1 4 16 \
      --sweep-placements 0:50,0:50,0:50 0:50,0:50,0:100 --solo-spinners 1 2 --out "$OUT/afd_sweep"
    run_step decode 280 python3 tools/bench_decode.py --quick --placement ffn-free ffn-bound --timeline --out "$OUT/decode" ;;
  corun1)  # one GPU, MPS: what ranks sharing the GPU cost each other (the planner's contention term)
    run_step corun 240 python3 tools/bench_corun.py --out "$OUT/corun" ;;
  soak1)  # one GPU, MPS: the fault model's soak over topologies, wire modes and transports;
    # a rank still running at --timeout is reported with its Python stacks (launch)
    SOAK="python3 tools/soak.py --stall-prob 0.0002 --progress-s 10"
    run_step soak_2a2f_pair 100 $SOAK --attn 2 --ffn 2 --round-trips 5000 --timeout 80 --out "$OUT/soak_2a2f_pair"
    run_step soak_2a2f_dedup 100 $SOAK --attn 2 --ffn 2 --wire-mode dedup --round-trips 5000 --timeout 80 --out "$OUT/soak_2a2f_dedup"
    run_step soak_1a2f_dedup_put 90 $SOAK --attn 1 --ffn 2 --wire-mode dedup --transport put --round-trips 10000 --timeout 70 --out "$OUT/soak_1a2f_dedup_put"
    run_step soak_2a1f_pair_put 90 $SOAK --attn 2 --ffn 1 --transport put --round-trips 10000 --timeout 70 --out "$OUT/soak_2a1f_pair_put"
    run_step soak_1a1f_pair 120 $SOAK --round-trips 80000 --timeout 100 --out "$OUT/soak_1a1f_pair"
    # the same ranks let exit on their own: are CUDA's per-process /dev/shm files still left?
    run_step soak_1a1f_exit 40 $SOAK --round-trips 2000 --timeout 25 --exit-grace-s 10 --out "$OUT/soak_1a1f_exit" ;;
  moe1)  # one GPU, MPS: the MoE layer, one process vs AFD 1A1F
    run_step moe_tests 70 python3 -m pytest -m cuda -q -p no:cacheprovider --timeout=60 -rfEs tests/unit/test_expert_gemm.py
    run_step moe_layer 240 python3 tools/bench_moe_layer.py --quick --out "$OUT/moe_layer" ;;
  stream1)  # one GPU: the streamed expert GEMMs (Triton), tests then the tile sweep
    run_step stream_tests 150 python3 -m pytest -m cuda -q -p no:cacheprovider --timeout=120 -rfEs \
      tests/kernels/test_stream_gemm_cuda.py tests/unit/test_expert_gemm.py
    run_step stream_sweep 400 python3 tools/bench_stream_gemm.py --quick ${STREAM_ARGS:-} --out "$OUT/stream" ;;
  kernels1)  # one GPU, no MPS: the round trip's kernels one by one, then under Nsight Compute
    KC=${KERNELS_CONFIGS:-"pair:fused:identity dedup:fused:identity dedup:ll:identity dedup:fused:staging"}
    # a baseline tree carried as .base/ (git archive of an older commit + this bench_kernels.py):
    # the same configs, same call, before the current tree's
    [ ! -d .base ] || NO_MPS=1 run_step bench_kernels_base 200 bash -c \
      "cd .base && PYTHONPATH=\$PWD python3 tools/bench_kernels.py --configs $KC --rows ${KERNELS_ROWS:-200} --out $OUT/kernels_base"
    NO_MPS=1 run_step bench_kernels 200 python3 tools/bench_kernels.py --configs $KC --rows ${KERNELS_ROWS:-200} --out "$OUT/kernels"
    if command -v ncu >/dev/null; then
      for config in ${NCU_CONFIGS:-$KC}; do
        n=5; case "$config" in dedup*) n=6 ;; esac  # kernels per row; the second row is profiled
        tag=$(echo "$config" | tr ':' '_')
        NO_MPS=1 run_step "ncu_$tag" 150 bash -c "ncu --clock-control none --kernel-name regex:afd_ --launch-skip $n \
          --launch-count $n ${NCU_SECTIONS:---section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis} \
          -f -o $OUT/ncu_$tag python3 tools/bench_kernels.py --eager --no-stamps --warmup 1 --rows 1 --tokens 128 \
          --configs $config --out $OUT/ncu_$tag.d; ncu -i $OUT/ncu_$tag.ncu-rep --page details > $OUT/ncu_$tag.txt"
      done
    fi ;;
  stream2)  # one GPU: the MoE step and layer with GraphFFNServer(expert_gemm="stream")
    MOE="--quick --layers 10 --tokens 128 --stages 1 --trace --experts moe --hidden 2048 --top-k 6 --intermediate 1408 --shared-experts 2 --num-experts 64"
    run_step step_moe_grouped 150 python3 tools/bench_step_graph.py $MOE --out "$OUT/step_moe_grouped"
    run_step step_moe_stream 150 python3 tools/bench_step_graph.py $MOE --ffn-expert-gemm stream --out "$OUT/step_moe_stream"
    run_step moe_layer_stream 250 python3 tools/bench_moe_layer.py --quick --shapes v2lite qwen3 --tokens 1 8 128 \
      --gemm-variants none --no-fp8 --ffn-expert-gemm stream --out "$OUT/moe_layer_stream" ;;
  fp8e2e)  # one GPU: FP8 end to end in the graph FFN (FP8 wire rows decoded by its gather, FP8 experts)
    run_step fp8_tests 120 python3 -m pytest -m cuda -q -p no:cacheprovider --timeout=110 -rfEs -k "fp8 or FP8" \
      tests/kernels/test_ffn_graph_cuda.py tests/integration/test_fp8_dispatch.py
    FP8L="--quick --shapes v2lite v3 --tokens 1 128 --gemm-variants none --no-fp8 --ffn-expert-gemm stream"
    run_step moe_layer_bf16_stream 200 python3 tools/bench_moe_layer.py $FP8L --out "$OUT/moe_layer_bf16_stream"
    run_step moe_layer_fp8_e2e 200 python3 tools/bench_moe_layer.py $FP8L --dispatch-dtype fp8_e4m3 \
      --ffn-fp8-experts --out "$OUT/moe_layer_fp8_e2e" ;;
  stream3)  # one GPU: prefill candidates against the grouped GEMM and the dense rate
    run_step stream_prefill 400 python3 tools/bench_stream_gemm.py --quick --tokens 4096 --block-m 64 128 \
      --block-n 64 128 --block-k 64 --warps 4 8 --stages 3 --out "$OUT/stream_prefill"
    run_step moe_layer_prefill 150 python3 tools/bench_moe_layer.py --quick --tokens 4096 --no-afd --no-fp8 \
      --gemm-variants padded_bmm --out "$OUT/moe_layer_prefill" ;;
  mps1)  # one GPU: the round trip's kernels alone, under MPS, at a share, beside a spinner
    KC=${KERNELS_CONFIGS:-"pair:fused:identity dedup:fused:identity"}
    BK="python3 tools/bench_kernels.py --configs $KC --rows ${KERNELS_ROWS:-200}"
    NO_MPS=1 run_step mps_none 120 $BK --out "$OUT/mps_none"
    run_step mps_full 120 $BK --out "$OUT/mps_full"
    run_step mps_half 120 env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 $BK --out "$OUT/mps_half"
    run_step mps_half_spin 150 bash -c "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 python3 tools/spin_neighbor.py \
      --seconds 140 & sp=\$!; sleep 5; CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 $BK --out $OUT/mps_half_spin; rc=\$?; kill \$sp; wait; exit \$rc" ;;
  trace1)  # one GPU: the round trip by phase (both dispatch kernels, both FFN modes), the gate
    SG="python3 tools/bench_step_graph.py --quick --layers 50 --tokens 128 --stages 1 --trace"
    run_step step_fused 120 $SG --dispatch fused --out "$OUT/step_fused"
    run_step step_gate_torch 120 $SG --dispatch fused --gate-impl torch --out "$OUT/step_gate_torch"
    run_step step_two_kernel 120 $SG --dispatch two-kernel --ffn-stage two-kernel --out "$OUT/step_two_kernel"
    run_step step_dedup 120 $SG --wire-mode dedup --out "$OUT/step_dedup"
    run_step step_dedup_3k 120 $SG --wire-mode dedup --dispatch two-kernel --out "$OUT/step_dedup_3k"
    run_step step_streams 150 python3 tools/bench_step_graph.py --quick --layers 50 --tokens 128 --stages 1 2 4 --stage-streams both --out "$OUT/step_streams"
    MOE="--layers 10 --tokens 128 --stages 1 --trace --experts moe --hidden 2048 --top-k 6 --intermediate 1408 --shared-experts 2"
    run_step step_moe_c0 100 python3 tools/bench_step_graph.py --quick $MOE --gemm-sm-carveout 0 --out "$OUT/step_moe_c0"
    run_step step_moe_auto 100 python3 tools/bench_step_graph.py --quick $MOE --out "$OUT/step_moe_auto"
    NO_MPS=1 run_step gate 90 python3 tools/bench_gate.py --quick --out "$OUT/gate" ;;
esac
case "$MODE" in twogpu*|trace1|soak1|moe1|stream1|stream2|stream3|fp8e2e|mps1|plan1|corun1|kernels1) MODE=none ;; esac
if [ "$MODE" != bench ] && [ "$MODE" != none ]; then
DESELECT=()
[ -z "${SERIAL_K:-}" ] || DESELECT=(-k "not ($SERIAL_K)")
run_step pytest_cuda "$SUITE_TIMEOUT" python3 -m pytest -m cuda -q -p no:cacheprovider ${PYTEST_ARGS:-} \
  ${DESELECT[@]+"${DESELECT[@]}"} --timeout=${TEST_TIMEOUT:-90} -rfEs --durations=25 $TEST_FILES
# the tests SERIAL_K selects, one at a time (docs/performance.md, Known issues: NVSHMEM jobs
# starting at the same time)
[ -z "${SERIAL_K:-}" ] || run_step pytest_cuda_serial "${SERIAL_TIMEOUT:-150}" python3 -m pytest -m cuda -q \
  -p no:cacheprovider -k "$SERIAL_K" --timeout=${TEST_TIMEOUT:-90} -rfEs $TEST_FILES
# the end-to-end cases again with host polling and WITHOUT MPS (no spinning kernels at all)
[ "${SKIP_HOSTPOLL:-0}" = 1 ] || AFD_TEST_POLL_MODE=host NO_MPS=1 run_step pytest_hostpoll "${HOSTPOLL_TIMEOUT:-300}" \
  python3 -m pytest -m cuda -q -p no:cacheprovider --timeout=${TEST_TIMEOUT:-90} -rfEs tests/integration/test_e2e.py tests/stress/test_e2e_errors.py tests/stress/test_faults.py
# (timed: wall and CPU time of the whole main job go to the end of its log)
[ "${SKIP_SMOKE_1A1F:-0}" = 1 ] || run_step smoke_1a1f 120 bash -c "time python3 tools/smoke.py --layers 4 ${SMOKE_ARGS:-}"
[ "${SKIP_SMOKE_2A2F:-0}" = 1 ] || run_step smoke_2a2f 150 bash -c "time python3 tools/smoke.py --2a2f --layers 4 ${SMOKE_ARGS:-}"
# a Hugging Face MoE model of every adapter family, disaggregated 1A2F vs one process (tokens/s)
[ "${SKIP_HF:-0}" = 1 ] || ! python3 -c "import transformers" 2>/dev/null || run_step hf_generate 180 \
  python3 tools/hf_generate.py --ffn 2 --steps 16 --out "$OUT"
# random sizes, layers, stages and stalls, every output checked (the fault model's soak)
[ "${SKIP_SOAK:-0}" = 1 ] || run_step soak "${SOAK_TIMEOUT:-300}" python3 tools/soak.py \
  --round-trips "${SOAK_N:-100000}" --timeout $(( ${SOAK_TIMEOUT:-300} - 20 )) --out "$OUT" ${SOAK_ARGS:-}
fi
if [ "$MODE" = full ] || [ "$MODE" = bench ]; then
  for bench in ${BENCHES:-bench_transport bench_afd}; do
    [ -f "tools/$bench.py" ] && run_step "$bench" "${BENCH_TIMEOUT:-240}" python3 "tools/$bench.py" --quick --out "$OUT" ${BENCH_ARGS:-}
  done
fi
stop_mps

echo
echo "==== tail of failing logs ===="
for name in "${!RESULT[@]}"; do
  case "${RESULT[$name]}" in rc=0*) ;; *) echo "--- $name"; tail -40 "$OUT/$name.log";; esac
done
echo
{
echo "==== afd_cupy GPU suite summary (${AFD_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown-commit)}, $(head -1 "$OUT/gpu.txt")) ===="
for name in "${STEP_ORDER[@]}"; do
  printf '%-17s %s\n' "$name" "${RESULT[$name]}"
done
} | tee "$OUT/summary.txt"
# NOTE: the device tool brings back at most 8 files: pack every log, JSON and plot into one.
PACKED=$(mktemp /tmp/afd_suite_logs.XXXXXX)
tar -czf "$PACKED" -C "$OUT" --exclude=./summary.txt . \
  && find "$OUT" -mindepth 1 -maxdepth 1 ! -name summary.txt -exec rm -rf {} + \
  && mv "$PACKED" "$OUT/suite_logs.tar.gz"
