"""One training step of a tiny DEXML model on this process's half of a batch, under torch.distributed (gloo).

Run by tests/test_distributed.py as ``python -m torch.distributed.run --nproc_per_node 2 tests/dist_step.py ENC
BATCHES OUT`` (fresh processes: forking a process whose OpenMP threads are running can deadlock). Rank 0 writes the
losses of every process and the process-averaged gradients (what DDP applies) to OUT/rank0.pt.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.test_distributed import tiny_model  # noqa: E402


def main(encoder_dir: str, batches_path: str, out_dir: str) -> None:
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batch = torch.load(batches_path)[rank]
    model = tiny_model(encoder_dir)
    out = model(**batch)
    out.loss.backward()
    losses = [torch.zeros(()) for _ in range(world)]
    torch.distributed.all_gather(losses, out.loss.detach())
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.distributed.all_reduce(p.grad)  # what DDP does (then divides by the world size)
            grads[name] = p.grad / world
    if rank == 0:
        torch.save({"losses": torch.stack(losses), "grads": grads, "pool": out.logits.shape[1]}, os.path.join(out_dir, "rank0.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
