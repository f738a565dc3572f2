#!/usr/bin/env bash
# Every GPU-only path in one short run, for a machine with CUDA GPUs (about 8 minutes on one GPU).
#
#   bash tests/gpu/run_all.sh            # from the repository root, after `make install`
#
# Each check prints one summary line (PASS, FAIL or SKIP, its name and its seconds); the output of
# a failing check is shown after its line, and the rest go to build/gpu/NAME.log. The CPU suite is
# not run here (`make test` does that): only the tests marked `gpu`, then the GPU commands:
#   tests            the CUDA-marked tests (nccl, CUDA AMP + GradScaler, pinned loaders, the
#                    non-finite check without a host sync, map_location from cuda:0...)
#   doctor           `lockstep doctor` on every visible GPU
#   train-bf16       `lockstep train`, bf16-mixed, one epoch on every GPU
#   train-compile    compiled training (inductor) on nccl
#   bench-compile    a 1-process compiled bench cell
#   resnet50         the ResNet-50 throughput rows (lockstep vs a hand-written loop, compiled)
#   checkpoint       a non-blocking save from CUDA tensors, timed against a blocking one
#   project-convnet  `lockstep bench --project`: this GPU's profile of the bundled ConvNet projected
#                    to an 8-GPU NVLink node and to 2 such nodes over InfiniBand HDR (project.json,
#                    project.png in build/gpu/project-convnet/)
#   project-resnet50 the same for ResNet-50 at 224 px, bf16-mixed (build/gpu/project-resnet50/)
# and with 2 GPUs or more (skipped by name on one GPU): train-sync-bn, train-dp,
# train-fp16-hook, train-powersgd, bench-ddp-variants, and doctor-links (the allreduce bandwidth
# between this node's GPUs, NVLink or PCIe, which `doctor` prints per size).
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=.venv/bin
LOGS=build/gpu
mkdir -p "$LOGS"
if ! $BIN/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible: these checks need a GPU machine" >&2
    exit 2
fi
ngpu=$($BIN/python -c "import torch; print(torch.cuda.device_count())")
echo "== $ngpu GPU(s)"
failed=0

# check NAME LIMIT_S COMMAND...: run one check under a time limit and print its summary line
check() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    if timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1; then
        printf 'PASS %-20s %4ds  %s\n' "$name" $((SECONDS - start)) "$(tail -n 1 "$LOGS/$name.log")"
    else
        local rc=$?
        failed=$((failed + 1))
        printf 'FAIL %-20s %4ds  exit %s (log %s)\n' "$name" $((SECONDS - start)) "$rc" "$LOGS/$name.log"
        tail -n 30 "$LOGS/$name.log" | sed 's/^/    /'
    fi
}

# two_gpus NAME LIMIT_S COMMAND...: a check that needs 2 GPUs, skipped by name on one
two_gpus() {
    if [ "$ngpu" -gt 1 ]; then
        check "$@"
    else
        printf 'SKIP %-20s          needs 2 GPUs, %s visible\n' "$1" "$ngpu"
    fi
}

check tests 150 $BIN/python -m pytest -q -rs -m gpu tests
check doctor 45 $BIN/lockstep doctor --nproc gpu
check train-bf16 60 $BIN/lockstep train --nproc gpu --precision bf16-mixed --epochs 1
check train-compile 90 $BIN/lockstep train --nproc gpu --compile --epochs 1
check bench-compile 90 $BIN/lockstep bench --model convnet --nproc 1 --strategies ddp --precision bf16-mixed --compile
check resnet50 120 $BIN/python benchmarks/gpu_resnet50.py --steps 20 --rounds 2 --compile inductor \
    --ddp-variants bf16,fp16,powersgd,compile,zero
check checkpoint 45 $BIN/python benchmarks/checkpoint.py --mb 400 --saves 2
check project-convnet 60 $BIN/lockstep bench --project --model convnet --gpus-per-node 8 --intra nvlink \
    --nodes 1,2 --link ib-hdr --out "$LOGS/project-convnet"
check project-resnet50 120 $BIN/lockstep bench --project --model resnet50 --image-size 224 --batch-size 64 \
    --precision bf16-mixed --gpus-per-node 8 --intra nvlink --nodes 1,2 --link ib-hdr --max-steps 20 \
    --out "$LOGS/project-resnet50"
two_gpus doctor-links 60 $BIN/lockstep doctor --nproc gpu --sizes 1M..256M --iters 20
two_gpus train-sync-bn 90 $BIN/lockstep train --nproc gpu --sync-bn --epochs 1
two_gpus train-dp 90 $BIN/lockstep train --nproc 1 --strategy dp --epochs 1
two_gpus train-fp16-hook 90 $BIN/lockstep train --nproc 2 --grad-compression fp16 --epochs 1
two_gpus train-powersgd 90 $BIN/lockstep train --nproc 2 --grad-compression powersgd --epochs 1
two_gpus bench-ddp-variants 180 $BIN/lockstep bench --model convnet --nproc 2 \
    --strategies ddp,ddp+bf16,ddp+fp16,ddp+powersgd,ddp+zero --precision bf16-mixed

echo "== $failed check(s) failed"
[ "$failed" -eq 0 ]
