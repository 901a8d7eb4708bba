"""DEXML's all-label mode in two processes (gloo, CPU), run by tests/test_all_label_loss.py as
``python -m torch.distributed.run --nproc_per_node 2 tests/dist_all_label.py ENC TASK_DIR OUT``.

1. One XMCTrainer step with ``label_pool="all"`` on 8 queries (4 per process; each process encodes its half of the
   labels): rank 0 saves the parameters after the step and the logged loss.
2. ``DEXMLModel.all_label_loss`` on fixed float64 tensors, 3 queries on rank 0 and 4 on rank 1, labels split 11 / 12:
   rank 0 saves the inputs, every process's loss and the gradients of every query and label (each from its owner).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_xmc.data import XMCDataset  # noqa: E402
from hf_xmc.models.encoder_utils import all_gather_rows  # noqa: E402
from hf_xmc.training import XMCTrainer  # noqa: E402
from hf_xmc.training.collator import label_shard_bounds  # noqa: E402
from tests.test_all_label_loss import NUM_LABELS, POSITIVE_IDS, all_label_args, tiny_model  # noqa: E402
from tests.tiny import make_tiny_task  # noqa: E402


def eight_queries(data) -> XMCDataset:
    """The first 8 training queries: one step of 8 (one process) or 2 x 4 (two processes) covers all of them."""
    return XMCDataset(data.train.texts[:8], data.train.targets[:8], data.train.uids[:8])


def trainer_step(encoder_dir: str, out_dir: str) -> dict:
    data, _ = make_tiny_task(os.path.join(out_dir, f"task{os.environ['RANK']}"))  # the fixture's task (same seed)
    model = tiny_model(encoder_dir)
    args = all_label_args(os.path.join(out_dir, "trainer"), per_device_train_batch_size=4, max_steps=1)
    trainer = XMCTrainer(model=model, args=args, train_dataset=eight_queries(data), label_texts=data.label_texts)
    assert args.world_size == 2 and len(trainer._label_shard_tokens()) == len(data.label_texts) // 2
    trainer.train()
    loss = next(row["loss"] for row in trainer.state.log_history if "loss" in row)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "trainer_loss": loss}


def sharded_loss(encoder_dir: str) -> dict:
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(3)
    queries = torch.randn(POSITIVE_IDS.shape[0], 5, generator=gen, dtype=torch.float64)
    labels = torch.randn(NUM_LABELS, 5, generator=gen, dtype=torch.float64)
    rows = slice(0, 3) if rank == 0 else slice(3, None)
    start, stop = label_shard_bounds(NUM_LABELS, rank, 2)
    q = queries[rows].clone().requires_grad_()
    z = labels[start:stop].clone().requires_grad_()
    model = tiny_model(encoder_dir, temperature=0.3)
    loss = model.all_label_loss(q, z, POSITIVE_IDS[rows], label_offset=start, chunk_size=4)
    loss.backward()
    losses = [torch.zeros((), dtype=loss.dtype) for _ in range(2)]
    torch.distributed.all_gather(losses, loss.detach())
    return {
        "queries": queries, "labels": labels, "positive_ids": POSITIVE_IDS, "losses": torch.stack(losses),
        "query_grads": all_gather_rows(q.grad, with_grad=False), "label_grads": all_gather_rows(z.grad, with_grad=False),
    }


def main(encoder_dir: str, task_dir: str, out_dir: str) -> None:
    result = trainer_step(encoder_dir, out_dir)  # Accelerate sets up the process group (gloo)
    result.update(sharded_loss(encoder_dir))
    if torch.distributed.get_rank() == 0:
        torch.save(result, os.path.join(out_dir, "rank0.pt"))
    torch.distributed.barrier()
    # Tear gloo down before the interpreter exits: a live process group's threads at exit abort the process
    # ("terminate called without an active exception"), which failed CI once.
    torch.distributed.destroy_process_group()
    # ... and skip the interpreter's own teardown: the same abort came back once more (2026-12-05, rank 1, under the
    # full suite) from a native thread still joinable at exit; everything this worker reports is saved by now
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:4])
