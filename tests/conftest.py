"""Shared fixtures: a tiny planted XMC task and a tiny random BERT encoder, built locally (no network)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests.tiny import make_tiny_encoder, make_tiny_task  # noqa: E402

# The slowest test files, slowest first (seconds of their slowest tests, 2 cores, 2026-11-29: test_scale 195,
# test_reliability 168, test_mufin_training 136, ...). Under the README's ``-n 2 --dist loadfile`` each worker takes
# the next file when it has finished one; xdist's own order (most tests first) can leave a 200 s file to the end of
# one worker while the other idles. Started first, the slow files let both workers end together.
SLOW_FILES = (
    "tests/test_scale.py", "tests/test_reliability.py", "tests/test_mufin_training.py", "tests/test_validation.py",
    "tests/test_quickstart.py", "tests/test_training_engine.py", "tests/models/test_modeling_prime.py", "tests/test_training.py",
    "tests/test_onnx_encoder.py", "tests/models/test_modeling_mufin.py", "tests/models/test_modeling_unidec.py", "tests/test_distributed.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the collection order below (no reordering by test count)
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(SLOW_FILES)))  # stable: each file stays whole and in order


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    """A planted task (XCData) and its XC raw files: (data, directory with trn/tst/lbl.json.gz)."""
    return make_tiny_task(str(tmp_path_factory.mktemp("tiny_task")))


@pytest.fixture(scope="session")
def tiny_encoder_dir(tmp_path_factory, tiny_task):
    """Directory of a tiny random BERT encoder + WordPiece tokenizer covering the task's words."""
    data, _ = tiny_task
    return make_tiny_encoder(str(tmp_path_factory.mktemp("tiny_encoder")), data)
