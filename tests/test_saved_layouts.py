"""Models saved by earlier code keep loading and predicting identically.

``tests/fixtures/saved_e5b7bd3`` holds four tiny models (DEXML with a lexical channel, UniDEC, PRIME, SiameseXML; 24
labels, a 16-wide random BERT) saved by the code of commit e5b7bd3, before the model package was cut into modules, with
the top-5 that code predicted for eight queries (``expected.json``; ``build_fixture.py`` made both). Every file of
those directories is kept but the remote-code ``*.py`` copies (a frozen second copy of the old package that nothing
here runs). They are loaded by today's classes in this process, re-saved by today's code and loaded through remote
code from that save, in a process where hf_xmc cannot be imported: every way must give the saved label ids and scores.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hf_xmc.models import DEXMLModel, PRIMEModel, SiameseXMLModel, UniDECModel

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "saved_e5b7bd3")
CLASSES = {"dexml": DEXMLModel, "unidec": UniDECModel, "prime": PRIMEModel, "siamesexml": SiameseXMLModel}
EXPECTED = json.load(open(os.path.join(FIXTURE, "expected.json")))

# every directory named on the command line through remote code, in one process where hf_xmc cannot be imported
REMOTE_PREDICT_ALL = textwrap.dedent(
    """
    import json, sys
    sys.modules["hf_xmc"] = None
    from transformers import AutoModel
    queries, results = json.loads(sys.argv[1]), {}
    for directory in sys.argv[2:]:
        model = AutoModel.from_pretrained(directory, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        pred = model.predict(queries, k=5)
        results[directory] = {"ids": pred.label_ids.tolist(), "scores": pred.scores.tolist()}
    print("RESULT " + json.dumps(results))
    """
)


def assert_same_top_k(ids, scores, expected: dict) -> None:
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(expected["ids"]))
    np.testing.assert_allclose(np.asarray(scores), np.asarray(expected["scores"]), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def resaved(tmp_path_factory) -> dict:
    """Each fixture model loaded by today's classes (copied first: loading may rebuild an index, never inside tests/)
    and saved again by today's code: ``{method: (loaded model, re-saved directory)}``."""
    root = tmp_path_factory.mktemp("saved_layouts")
    models = {}
    for method, model_class in CLASSES.items():
        shutil.copytree(os.path.join(FIXTURE, method), root / method)
        model = model_class.from_pretrained(root / method)
        model.save_pretrained(root / f"{method}-resaved")
        models[method] = (model, str(root / f"{method}-resaved"))
    return models


@pytest.mark.parametrize("method", sorted(CLASSES))
def test_a_model_saved_by_earlier_code_loads_and_predicts_identically(method, resaved):
    model, _ = resaved[method]
    assert type(model).__module__.startswith("hf_xmc.models")  # today's class, not the saved remote code
    pred = model.predict(EXPECTED["queries"], k=5)
    assert_same_top_k(pred.label_ids, pred.scores, EXPECTED["models"][method])
    if method == "dexml":
        assert model.lexical_channel is not None  # the channel came back, and its fused scores are the ones above


def test_resaved_by_todays_code_they_predict_identically_through_remote_code(resaved, tmp_path):
    directories = [directory for _, directory in resaved.values()]
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", PYTHONPATH="")
    proc = subprocess.run(
        [sys.executable, "-c", REMOTE_PREDICT_ALL, json.dumps(EXPECTED["queries"]), *directories],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][0][7:])
    for method, (_, directory) in resaved.items():
        assert_same_top_k(got[directory]["ids"], got[directory]["scores"], EXPECTED["models"][method])
