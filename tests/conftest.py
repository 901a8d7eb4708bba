"""Shared fixtures: a tiny planted XMC task and a tiny random BERT encoder, built locally (no network)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests.tiny import make_tiny_encoder, make_tiny_task  # noqa: E402


def pytest_configure(config):
    """A pytest-xdist worker (the README runs ``-n 2`` on 2 cores) computes on one thread, and so does every process
    its tests start (``OMP_NUM_THREADS``, inherited): two workers of two threads each, plus the training scripts
    they launch, oversubscribed the cores."""
    if hasattr(config, "workerinput"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("MKL_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    """A planted task (XCData) and its XC raw files: (data, directory with trn/tst/lbl.json.gz)."""
    return make_tiny_task(str(tmp_path_factory.mktemp("tiny_task")))


@pytest.fixture(scope="session")
def tiny_encoder_dir(tmp_path_factory, tiny_task):
    """Directory of a tiny random BERT encoder + WordPiece tokenizer covering the task's words."""
    data, _ = tiny_task
    return make_tiny_encoder(str(tmp_path_factory.mktemp("tiny_encoder")), data)
