#!/usr/bin/env python
"""GPU smoke checks of the CUDA code paths (tiny models, seconds per check).

    python benchmarks/gpu_smoke.py [--device cuda] [--steps 60]

1. training: a tiny random BERT (tests/tiny.py) on the planted tiny task trains through ``XMCTrainer`` with AMP
   (bf16, and fp16 for DEXML) on the device, for DEXML, PRIME and UniDEC, with and without the gradient cache;
   it evaluates, saves (``trainer.save_model``), reloads with ``AutoModel.from_pretrained(dir,
   trust_remote_code=True)`` onto the device and must predict the same top-5 as the trained model.
2. encoding: ``encode_queries`` of one model on the device vs on the CPU (max abs difference).
3. gradient cache on the device (tiny BERT, dropout 0.1): eval mode, cached vs one-shot uncached gradients; train
   mode, cached vs an uncached run that encodes the same chunks (the CUDA RNG replay); without the replay the
   gradients must differ; the replay leaves the CUDA RNG where the uncached run leaves it; the same under
   bf16 autocast.
4. label index: exact faiss (CPU build, or the GPU copy when a faiss GPU build sees a GPU), torch search on the
   device and torch search on the CPU return the same top-k over 100k random label vectors.

Prints a table and writes benchmarks/results/gpu_smoke.json (``--out``). Exit status 1 when a check fails.
"""

import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.harness import bench_parser, markdown_table, result_path, write_json  # noqa: E402

CHECKS: list[dict] = []
#: the report's path while the checks run (main sets it): every check rewrites it, so a run cut short (a time limit,
#: benchmarks/gpu_check.sh's budget) keeps the checks it finished, marked ``"partial": true``
PARTIAL_OUT: str | None = None

REMOTE_PREDICT = """
import json, sys
sys.modules["hf_xmc"] = None  # hf_xmc must not be importable: everything comes from the model directory
import torch
from transformers import AutoModel
model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).to(sys.argv[3])
pred = model.predict(json.loads(sys.argv[2]), k=5)
print("RESULT " + json.dumps({"module": type(model).__module__, "device": str(next(model.parameters()).device),
                             "ids": pred.label_ids.tolist(), "scores": pred.scores.tolist()}))
"""


def remote_predict(save_dir: str, texts: list, device: str) -> dict:
    """Reload ``save_dir`` through remote code in a fresh process without hf_xmc and predict on ``device``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # the repo off the path (hf_xmc must come from the model directory); other entries stay: the packages a
    # bundle for a machine without network puts there (benchmarks/gpu_check.sh) are the ones this run imports
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != REPO]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    proc = subprocess.run([sys.executable, "-c", REMOTE_PREDICT, save_dir, json.dumps(texts), device], capture_output=True,
                          text=True, env=env, cwd=save_dir, timeout=300, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"remote-code reload failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def record(name: str, passed: bool, **details) -> None:
    CHECKS.append({"check": name, "passed": bool(passed), **details})
    if PARTIAL_OUT:
        write_json(PARTIAL_OUT, {"partial": True, "checks": CHECKS}, sort_keys=False, default=str)
    shown = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in details.items() if k != "error")
    print(f"[{'PASS' if passed else 'FAIL'}] {name}: {shown}", flush=True)
    if "error" in details:
        print(details["error"], flush=True)


def guarded(name: str):
    """Run a check function; an exception is a failed check with its traceback."""

    def wrap(fn):
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception:  # noqa: BLE001 - a smoke run reports every failure and goes on
                record(name, False, error=traceback.format_exc()[-3000:])

        return run

    return wrap


# ------------------------------------------------------------------------------------------------ 1. training


def build_model(method: str, encoder_dir: str, data):
    from hf_xmc.models import DEXMLModel, PRIMEModel, UniDECModel

    common = dict(max_seq_length=16, label_max_seq_length=16)
    if method == "dexml":
        return DEXMLModel.from_encoder_pretrained(encoder_dir, **common)
    if method == "prime":
        return PRIMEModel.from_encoder_pretrained(encoder_dir, label_space_size=len(data.label_texts), lpn_intermediate_size=64, **common)
    return UniDECModel.from_encoder_pretrained(encoder_dir, label_space_size=len(data.label_texts), projection_dim=16, **common)


def check_training(method: str, precision: str, chunk: int, data, encoder_dir: str, device: str, steps: int, tmp: str) -> None:
    import numpy as np
    import torch
    from transformers import AutoModel

    from hf_xmc.training import XMCEvaluator, XMCTrainer, XMCTrainingArguments

    name = f"train {method} {precision}" + (f" gradcache {chunk}" if chunk else "")

    @guarded(name)
    def run():
        torch.manual_seed(0)
        model = build_model(method, encoder_dir, data)
        evaluator = XMCEvaluator(data.test, data.label_texts, train_targets=data.train.targets, recall_ks=(10,))
        before = evaluator(model)
        out_dir = os.path.join(tmp, name.replace(" ", "_"))
        args = XMCTrainingArguments(
            output_dir=out_dir, max_steps=steps, per_device_train_batch_size=32, learning_rate=2e-3 if method == "prime" else 5e-4,
            warmup_steps=0.1, save_strategy="no", seed=0, disable_tqdm=True, logging_steps=10, report_to=[],
            bf16=precision == "bf16", fp16=precision == "fp16", gradient_cache_chunk_size=chunk,
            use_cpu=device == "cpu", label_pool="psl" if method == "unidec" else "in_batch",
        )
        trainer = XMCTrainer(model=model, args=args, train_dataset=data.train, label_texts=data.label_texts, evaluator=evaluator)
        start = time.perf_counter()
        result = trainer.train()
        train_s = time.perf_counter() - start
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        after = trainer.evaluate()
        on_device = {p.device.type for p in model.parameters()} == {device}
        texts = list(data.test.texts[:64])
        pred = model.predict(texts, k=5)
        save_dir = os.path.join(out_dir, "final")
        trainer.save_model(save_dir)
        reloaded = AutoModel.from_pretrained(save_dir, trust_remote_code=True).to(device)  # hf_xmc's registered class
        pred2 = reloaded.predict(texts, k=5)
        same_ids = float(np.mean(pred.label_ids == pred2.label_ids))
        score_diff = float(np.abs(pred.scores - pred2.scores).max())
        remote_out = remote_predict(save_dir, texts, device)  # the saved remote code, without hf_xmc
        remote = remote_out["module"].startswith("transformers_modules") and remote_out["device"].startswith(device)
        remote_same = float(np.mean(pred.label_ids == np.asarray(remote_out["ids"])))
        remote_diff = float(np.abs(pred.scores - np.asarray(remote_out["scores"], dtype=np.float32)).max())
        learned = after["eval_P@1"] - before["test_P@1"]
        finite = bool(np.isfinite(losses).all()) and np.isfinite(result.training_loss)
        record(
            name,
            on_device and remote and finite and min(same_ids, remote_same) == 1.0 and max(score_diff, remote_diff) < 1e-4 and learned > 5,
            device=str(next(model.parameters()).device), P1_before=before["test_P@1"], P1_after=after["eval_P@1"],
            PSP5_after=after["eval_PSP@5"], first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
            train_s=train_s, reload_same_top5=same_ids, reload_max_score_diff=score_diff, remote_code_on_device=remote,
            remote_same_top5=remote_same, remote_max_score_diff=remote_diff,
        )

    run()


# ------------------------------------------------------------------------------------------------ 2. encoding


def check_encoding(data, encoder_dir: str, device: str) -> None:
    import torch

    @guarded("encode cpu vs device")
    def run():
        torch.manual_seed(0)
        model = build_model("dexml", encoder_dir, data)
        texts = list(data.test.texts)
        cpu = model.to("cpu").encode_queries(texts)
        dev = model.to(device).encode_queries(texts)
        diff = float((cpu - dev).abs().max())
        record("encode cpu vs device", dev.device.type == "cpu" and diff < 1e-4, max_abs_diff=diff, rows=len(texts))

    run()


# ------------------------------------------------------------------------------------------------ 3. gradient cache


def check_gradcache(device: str) -> None:
    import torch
    from transformers import BertConfig, BertModel

    from hf_xmc.models.xmc_losses import decoupled_softmax_loss
    from hf_xmc.training import gradcache
    from hf_xmc.training.gradcache import cached_loss

    vocab, chunk = 50, 6

    def group(rows, seq, seed):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (rows, seq), generator=gen)
        lengths = torch.randint(1, seq + 1, (rows,), generator=gen)
        return {"input_ids": ids.to(device), "attention_mask": (torch.arange(seq) < lengths[:, None]).long().to(device)}

    queries, labels = group(32, 8, 1), group(24, 6, 2)
    targets = (torch.rand(32, 24, generator=torch.Generator().manual_seed(3)) < 0.1).to(device)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=16, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    bert = BertModel(config, add_pooling_layer=False).to(device)

    def embed(c):
        hidden = bert(**c).last_hidden_state
        mask = c["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return torch.nn.functional.normalize(((hidden * mask).sum(1) / mask.sum(1)).float(), dim=-1)

    def loss_fn(q, lab):
        return decoupled_softmax_loss(q @ lab.T / 0.1, targets)

    def split(g, size):
        rows = g["input_ids"].shape[0]
        return [{k: v[i : i + size] for k, v in g.items()} for i in range(0, rows, size)]

    def plain(chunked):
        embs = [torch.cat([embed(c) for c in split(g, chunk)]) if chunked else embed(g) for g in (queries, labels)]
        return loss_fn(*embs)

    def run(fn, autocast=None):
        bert.zero_grad(set_to_none=True)
        torch.manual_seed(123)
        ctx = torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext()
        with ctx:
            loss = fn()
        loss.backward()
        rng = torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()
        return float(loss), {n: p.grad.detach().clone() for n, p in bert.named_parameters()}, rng

    def max_diff(a, b):
        return max(float((a[n] - b[n]).abs().max()) for n in a)

    def scale(g):
        return max(float(v.abs().max()) for v in g.values())

    @guarded("gradcache eval mode = one-shot uncached")
    def eval_mode():
        bert.eval()
        lc, gc, _ = run(lambda: cached_loss(embed, [queries, labels], loss_fn, chunk))
        lp, gp, _ = run(lambda: plain(False))
        d = max_diff(gc, gp)
        record("gradcache eval mode = one-shot uncached", d < 1e-4 * max(1.0, scale(gp)) and abs(lc - lp) < 1e-5,
               max_grad_diff=d, max_grad=scale(gp), loss_diff=abs(lc - lp))

    @guarded("gradcache dropout: RNG replay = chunked uncached")
    def dropout():
        bert.train()
        lc, gc, rng_c = run(lambda: cached_loss(embed, [queries, labels], loss_fn, chunk))
        lp, gp, rng_p = run(lambda: plain(True))
        d = max_diff(gc, gp)
        with contextlib.ExitStack() as stack:
            saved = gradcache.RandContext
            gradcache.RandContext = lambda *t: contextlib.nullcontext()
            stack.callback(setattr, gradcache, "RandContext", saved)
            _, gn, _ = run(lambda: cached_loss(embed, [queries, labels], loss_fn, chunk))
        d_noreplay = max_diff(gn, gp)
        same_rng = bool(torch.equal(rng_c, rng_p))
        record("gradcache dropout: RNG replay = chunked uncached",
               d < 1e-4 * max(1.0, scale(gp)) and d_noreplay > 100 * max(d, 1e-7) and same_rng and abs(lc - lp) < 1e-5,
               max_grad_diff=d, max_grad_diff_without_replay=d_noreplay, rng_state_same=same_rng, loss_diff=abs(lc - lp))

    @guarded("gradcache dropout + bf16 autocast = chunked uncached")
    def autocast():
        if device != "cuda":
            record("gradcache dropout + bf16 autocast = chunked uncached", True, skipped="no cuda")
            return
        bert.train()
        lc, gc, _ = run(lambda: cached_loss(embed, [queries, labels], loss_fn, chunk), autocast=torch.bfloat16)
        lp, gp, _ = run(lambda: plain(True), autocast=torch.bfloat16)
        d = max_diff(gc, gp)
        record("gradcache dropout + bf16 autocast = chunked uncached", d < 1e-2 * max(1.0, scale(gp)),
               max_grad_diff=d, max_grad=scale(gp), loss_diff=abs(lc - lp))

    eval_mode()
    dropout()
    autocast()


# ------------------------------------------------------------------------------------------------ 4. label index


def check_index(device: str) -> None:
    import numpy as np
    import torch

    from hf_xmc.index import LabelIndex, faiss_available, faiss_gpu_available

    rng = np.random.default_rng(0)
    labels = rng.standard_normal((100_000, 64)).astype(np.float32)
    queries = rng.standard_normal((2_000, 64)).astype(np.float32)
    k = 10

    def timed(index):
        index.search(queries[:10], k)  # builds GPU copies, loads kernels
        start = time.perf_counter()
        out = index.search(queries, k)
        return out, time.perf_counter() - start

    @guarded("label index: torch on device = torch on cpu")
    def torch_backends():
        (s_cpu, i_cpu), t_cpu = timed(LabelIndex(labels, kind="torch", use_gpu=False, chunk_size=16384))
        dev_index = LabelIndex(labels, kind="torch", use_gpu=device == "cuda", chunk_size=16384)
        (s_dev, i_dev), t_dev = timed(dev_index)
        # the vectors' copy on the GPU (kept between searches); on the CPU the search reads the blocks, no copy is made
        on = str(dev_index._torch_labels.device) if dev_index._torch_labels is not None else "cpu"
        same = float(np.mean(i_cpu == i_dev))
        diff = float(np.abs(s_cpu - s_dev).max())
        record("label index: torch on device = torch on cpu", same > 0.999 and diff < 1e-3 and on.startswith(device),
               labels_on=on, same_ids=same, max_score_diff=diff, cpu_s=t_cpu, device_s=t_dev)
        return s_cpu, i_cpu

    reference = torch_backends()
    if not faiss_available():
        record("label index: faiss exact", False, error="faiss is not installed")
        return

    @guarded("label index: faiss exact (auto) = torch")
    def faiss_auto():
        index = LabelIndex(labels, kind="exact")
        (s, i), t = timed(index)
        same = float(np.mean(i == reference[1]))
        diff = float(np.abs(s - reference[0]).max())
        record("label index: faiss exact (auto) = torch", same > 0.999 and diff < 1e-3, faiss_gpu=faiss_gpu_available(),
               use_gpu=index.use_gpu, on_gpu=bool(index.use_gpu and index._index is not None),  # exact: faiss GPU copy, else torch
               same_ids=same, max_score_diff=diff, search_s=t)

    faiss_auto()
    if faiss_gpu_available():

        @guarded("label index: faiss GPU = faiss CPU")
        def faiss_gpu():
            (s_g, i_g), t_g = timed(LabelIndex(labels, kind="exact", use_gpu=True))
            (s_c, i_c), t_c = timed(LabelIndex(labels, kind="exact", use_gpu=False))
            same = float(np.mean(i_g == i_c))
            record("label index: faiss GPU = faiss CPU", same > 0.999, same_ids=same,
                   max_score_diff=float(np.abs(s_g - s_c).max()), gpu_s=t_g, cpu_s=t_c)

        faiss_gpu()
    else:
        print("faiss GPU: not available (faiss build without GPU support, or no GPU); GPU index not checked", flush=True)
    del torch


def main() -> None:
    ap = bench_parser(__doc__, result_path("gpu_smoke.json"))
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--steps", type=int, default=60, help="training steps per run (15 steps = one epoch of the tiny task)")
    ap.add_argument("--only", nargs="+", default=["train", "encode", "gradcache", "index"])
    args = ap.parse_args()

    import torch

    from tests.tiny import make_tiny_encoder, make_tiny_task

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.time()
    global PARTIAL_OUT
    PARTIAL_OUT = args.out
    with tempfile.TemporaryDirectory() as tmp:
        data, _ = make_tiny_task(os.path.join(tmp, "task"))
        encoder_dir = make_tiny_encoder(os.path.join(tmp, "encoder"), data)
        if "train" in args.only:
            runs = [("dexml", "bf16", 0), ("dexml", "fp16", 0), ("dexml", "bf16", 8), ("prime", "bf16", 0), ("prime", "bf16", 8),
                    ("unidec", "bf16", 0), ("unidec", "bf16", 8)]
            if device == "cpu":
                runs = [r for r in runs if r[1] != "fp16"]
            for method, precision, chunk in runs:
                check_training(method, precision, chunk, data, encoder_dir, device, args.steps, tmp)
        if "encode" in args.only:
            check_encoding(data, encoder_dir, device)
        if "gradcache" in args.only:
            check_gradcache(device)
        if "index" in args.only:
            check_index(device)

    try:
        import faiss

        faiss_version = faiss.__version__
    except ImportError:
        faiss_version = None
    import transformers

    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__, "faiss": faiss_version,
        "steps": args.steps, "wall_seconds": time.time() - t0, "checks": CHECKS,
    }
    write_json(args.out, report, sort_keys=False, default=str)
    print(f"\nGPU smoke on {report['device']} (torch {report['torch']}, CUDA {report['cuda']}, transformers "
          f"{report['transformers']}, faiss {faiss_version}):\n")
    print(markdown_table(["check", "result"], [[c["check"], "pass" if c["passed"] else "FAIL"] for c in CHECKS]))
    print(f"\nwrote {args.out} ({report['wall_seconds']:.0f} s)")
    sys.exit(0 if all(c["passed"] for c in CHECKS) else 1)


if __name__ == "__main__":
    main()
