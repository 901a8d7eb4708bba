"""One DDP training step of a tiny UniDEC model per process (gloo), once with the classifier's sparse gradients and
once with dense ones, each followed by a SparseAdamW step.

Run by tests/test_distributed.py as ``python -m torch.distributed.run --nproc_per_node 2 tests/dist_sparse_step.py ENC
BATCHES OUT``. Each rank writes OUT/rank<r>.pt: per mode, the DDP-averaged gradients (dense) and the weights after
the optimizer step.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_xmc.training import SparseAdamW  # noqa: E402
from tests.test_distributed import tiny_unidec  # noqa: E402


def main(encoder_dir: str, batches_path: str, out_dir: str) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    batch = torch.load(batches_path)[rank]
    result = {}
    for sparse in (True, False):
        model = tiny_unidec(encoder_dir, sparse)
        # find_unused_parameters as the Trainer sets it (the encoder's pooler is unused); the classifier's sparse flag is read here
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        ddp(**batch).loss.backward()
        layouts = {name: p.grad.layout for name, p in model.named_parameters() if p.grad is not None}
        grads = {name: p.grad.to_dense() for name, p in model.named_parameters() if p.grad is not None}
        SparseAdamW(model.parameters(), lr=1e-2, weight_decay=0.01).step()
        result[sparse] = {"layouts": layouts, "grads": grads, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}
        del ddp
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
