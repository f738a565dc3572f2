"""A plain Horovod script, as Horovod's own ``examples/pytorch/pytorch_synthetic_benchmark.py``
is written (same flags, same calls, same result lines), with no lockstep in it; its GPU-only
``SyncBatchNorm`` is left out. Run it as Horovod's users do::

    horovodrun -np 2 --gloo python tests/scripts/horovod_synthetic_benchmark.py --model resnet18 --no-cuda
    lockstep run --nproc 2 tests/scripts/horovod_synthetic_benchmark.py --model resnet18 --no-cuda

Both must print ``Total img/sec on 2 CPU(s)``: one job of two ranks, not two jobs of one.
"""

import argparse
import timeit

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
from torchvision import models

parser = argparse.ArgumentParser(
    description="PyTorch Synthetic Benchmark", formatter_class=argparse.ArgumentDefaultsHelpFormatter
)
parser.add_argument("--fp16-allreduce", action="store_true", help="use fp16 compression during allreduce")
parser.add_argument("--model", default="resnet50", help="torchvision model to benchmark")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--num-warmup-batches", type=int, default=10, help="warm-up batches, not timed")
parser.add_argument("--num-batches-per-iter", type=int, default=10, help="batches per timed iteration")
parser.add_argument("--num-iters", type=int, default=10, help="timed iterations")
parser.add_argument("--no-cuda", action="store_true", help="disables CUDA training")
parser.add_argument("--use-adasum", action="store_true", help="use the Adasum reduction")
args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

hvd.init()
if args.cuda:
    torch.cuda.set_device(hvd.local_rank())

model = getattr(models, args.model)()
lr_scaler = 1 if args.use_adasum else hvd.size()
if args.cuda:
    model.cuda()
    if args.use_adasum and hvd.nccl_built():
        lr_scaler = hvd.local_size()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(
    optimizer,
    named_parameters=model.named_parameters(),
    compression=compression,
    op=hvd.Adasum if args.use_adasum else hvd.Average,
)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, 224, 224)
target = torch.LongTensor(args.batch_size).random_() % 1000
if args.cuda:
    data, target = data.cuda(), target.cuda()


def benchmark_step() -> None:
    optimizer.zero_grad()
    F.cross_entropy(model(data), target).backward()
    optimizer.step()


def log(text: str) -> None:
    if hvd.rank() == 0:
        print(text, flush=True)


device = "GPU" if args.cuda else "CPU"
log(f"Model: {args.model}")
log(f"Batch size: {args.batch_size}")
log(f"Number of {device}s: {hvd.size()}")
log("Running warmup...")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
log("Running benchmark...")
img_secs = []
for i in range(args.num_iters):
    img_sec = (
        args.batch_size * args.num_batches_per_iter / timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    )
    log(f"Iter #{i}: {img_sec:.1f} img/sec per {device}")
    img_secs.append(img_sec)
mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
log(f"Img/sec per {device}: {mean:.1f} +-{conf:.1f}")
log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
