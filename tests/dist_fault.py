"""A training script run in which rank 1 fails at its third step; rank 0 goes on to the collective rank 1 never joins.

Run by tests/test_reliability.py as ``accelerate launch ... tests/dist_fault.py FAULT SCRIPT ARGS...``: FAULT is
``bad_batch`` (a ValueError, what a malformed batch raises) or ``oom`` (torch's out-of-memory error); SCRIPT is a
training script, run unchanged with ARGS through ``runpy`` after rank 1's ``XMCTrainer.training_step`` is wrapped.
"""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(fault: str, script: str, argv: list[str]) -> None:
    if os.environ.get("RANK") == "1":
        import torch

        from hf_xmc.training.trainer import XMCTrainer

        step = XMCTrainer.training_step

        def failing_step(self, *args, **kwargs):
            if self.state.global_step == 2:
                if fault == "oom":
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected on rank 1)")
                raise ValueError("batch of step 2: injected bad batch on rank 1")
            return step(self, *args, **kwargs)

        XMCTrainer.training_step = failing_step
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
