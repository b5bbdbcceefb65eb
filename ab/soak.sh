set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NCCL=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
export CUDA_MPS_PIPE_DIRECTORY=/tmp/afd_mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/afd_mps_log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY $OUT
S="python3 tools/soak.py --stall-prob 0.0002 --timeout 40"
run() { name=$1; shift; echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; sleep 1; nvidia-cuda-mps-control -d; s=$(date +%s); timeout -k 5 50 $S "$@" --out $OUT/$name > $OUT/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s | $(grep -E 'SOAK' $OUT/$name.log | tail -1)"; grep -E "^(attention|ffn) |Error|rank . " $OUT/$name.log | head -8; }
run soak_2a2f_dedup --attn 2 --ffn 2 --wire-mode dedup --round-trips 3000
run soak_2a2f_pair --attn 2 --ffn 2 --round-trips 3000
run soak_1a2f_dedup_put --attn 1 --ffn 2 --wire-mode dedup --transport put --round-trips 5000
echo quit | nvidia-cuda-mps-control
tar -czf $OUT/soak.tar.gz -C $OUT --exclude=soak.tar.gz . 
