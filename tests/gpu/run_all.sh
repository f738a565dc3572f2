#!/usr/bin/env bash
# Every GPU-only path in one run, for a machine with CUDA GPUs (they skip elsewhere).
#
#   bash tests/gpu/run_all.sh            # from the repository root, after `make install`
#
# 1. the CUDA-only tests of the suite (nccl, CUDA AMP + GradScaler, DataParallel, SyncBatchNorm,
#    pinned-memory loaders, map_location from cuda:0);
# 2. `lockstep doctor` and `lockstep train` on every visible GPU (nccl, bf16-mixed, sync_bn);
# 3. the speed levers on CUDA: compiled training (inductor) on nccl, ddp's gradient compression
#    hooks on nccl, a non-blocking checkpoint saved from CUDA tensors and resumed (the suite's
#    CUDA test of the non-finite check without a host sync runs in step 1);
# 4. the ResNet-50 throughput benchmark (lockstep vs a hand-written loop, compiled; dp vs ddp with
#    >1 GPU, and ddp with each compression hook, compiled and with ZeRO).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=.venv/bin
if ! $BIN/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible: these checks need a GPU machine" >&2
    exit 2
fi
ngpu=$($BIN/python -c "import torch; print(torch.cuda.device_count())")
echo "== $ngpu GPU(s)"

# the whole suite: on a GPU machine the CUDA-only tests run instead of skipping (-rs lists any
# that still skip, e.g. those needing 2 GPUs on a 1-GPU machine)
$BIN/python -m pytest -q -rs tests

$BIN/lockstep doctor --nproc gpu
$BIN/lockstep train --nproc gpu --precision bf16-mixed --epochs 2
if [ "$ngpu" -gt 1 ]; then
    $BIN/lockstep train --nproc gpu --sync-bn --epochs 1
    $BIN/lockstep train --nproc 1 --strategy dp --epochs 1
fi
$BIN/python benchmarks/gpu_resnet50.py --compile inductor --ddp-variants bf16,fp16,powersgd,compile,zero

# speed levers: compile on nccl, compression hooks on nccl, async save from CUDA (bench cells
# need 2 GPUs for the multi-process rows; one GPU still runs the 1-process ones)
$BIN/lockstep train --nproc gpu --compile --epochs 1
if [ "$ngpu" -gt 1 ]; then
    $BIN/lockstep train --nproc 2 --grad-compression fp16 --epochs 1
    $BIN/lockstep train --nproc 2 --grad-compression powersgd --epochs 1
    $BIN/lockstep bench --model convnet --nproc 2 --strategies ddp,ddp+bf16,ddp+fp16,ddp+powersgd,ddp+zero --precision bf16-mixed
fi
$BIN/lockstep bench --model convnet --nproc 1 --strategies ddp --precision bf16-mixed --compile
$BIN/python benchmarks/checkpoint.py --mb 400
