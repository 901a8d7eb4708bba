"""Shared fixtures: a tiny planted XMC task and a tiny random BERT encoder, built locally (no network)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests.tiny import make_tiny_encoder, make_tiny_task  # noqa: E402


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    """A planted task (XCData) and its XC raw files: (data, directory with trn/tst/lbl.json.gz)."""
    return make_tiny_task(str(tmp_path_factory.mktemp("tiny_task")))


@pytest.fixture(scope="session")
def tiny_encoder_dir(tmp_path_factory, tiny_task):
    """Directory of a tiny random BERT encoder + WordPiece tokenizer covering the task's words."""
    data, _ = tiny_task
    return make_tiny_encoder(str(tmp_path_factory.mktemp("tiny_encoder")), data)
