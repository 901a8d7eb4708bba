#!/usr/bin/env python
"""MUFIN's defaults decided on validation: each default of ``train_mufin.py`` that an earlier table chose on test,
against its alternative, over several seeds, chosen by the validation split (issue 65).

    python benchmarks/make_emoji.py && python benchmarks/make_reuters.py
    python benchmarks/bench_mufin_defaults.py --datasets emoji reuters --seeds 42 43 44 --update_docs
    python benchmarks/bench_mufin_defaults.py --table_only --update_docs     # the table of --out, nothing run

The decisions (:data:`DECISIONS`), each the script's default against one alternative at the script's own budget (2
Module I + 3 Module IV epochs), every other flag at its default:

* **vision tower** built at random (no pretrained vision weights offline): the default small ResNet, or a ViT of
  about its size (``bench_mufin.make_vit``); Emoji-XMC only (Reuters has no images);
* **vision rate**: the vision tower at the text encoder's rate (``--vision_learning_rate_multiplier 1``) or 10x;
  Emoji-XMC only;
* **Module I batches**: over items (the official code's ``--doc_first``), or over labels as the paper describes
  (``--siamese_batch_over labels``); Emoji-XMC and Reuters-21578 (text only).

Every run holds out the validation split a training script carves by default (``sweep_defaults.validation_flags``:
5% of the training queries, at least 500, at most a fifth: 204 of Emoji-XMC's 1,021 points, 500 of Reuters' 7,770),
drawn with the run's seed, so each seed also draws its own split. Per (dataset, variant) the table gives the mean +-
sample std over the seeds of the validation P@1 and PSP@5 (what decides: :data:`benchmarks.harness.SELECTION_KEYS`,
their mean over seeds) and of the test P@1 / P@5 / PSP@5 (reported, never read to choose); ``chosen (<decision>)``
marks, per dataset, the variant of each decision with the best mean validation P@1 + PSP@5. Rows already in ``--out``
are kept (``--rerun`` runs them again). About 2 minutes a run on 2 CPU cores for Emoji-XMC, 3 for Reuters.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.bench_headline import spread  # noqa: E402
from benchmarks.bench_mufin import make_vit  # noqa: E402
from benchmarks.harness import (  # noqa: E402
    SELECTION_KEYS,
    bench_parser,
    chosen_by_group,
    cpu_name,
    git_commit,
    markdown_table,
    publish,
    read_json,
    result_path,
    write_json,
)
from benchmarks.sweep_defaults import minilm, prepare, run_training_script, validation_flags  # noqa: E402

EMOJI = os.path.join(REPO, "outputs", "emoji-xmc")
#: per dataset: the data directory's flags (Emoji-XMC: bench_mufin.py's shapes; Reuters: sweep_defaults' budget and
#: shapes, text only)
EMOJI_FLAGS = ["--max_seq_length", "16", "--propensity_a", "0.55", "--propensity_b", "1.5"]
#: variant -> (description, train_mufin.py flags; "VIT" stands for a random ViT's directory, built per run)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "defaults": ("train_mufin.py's defaults (random small ResNet, Module I over items, vision rate x1)", []),
    "vit_tower": ("a random small ViT for the ResNet", ["--vision_model_name_or_path", "VIT"]),
    "vision_lr10": ("the vision tower at 10x the text rate", ["--vision_learning_rate_multiplier", "10"]),
    "label_batches": ("Module I batches over labels (the paper)", ["--siamese_batch_over", "labels"]),
}
#: decision -> (the default's variant, the alternative's); each decided per dataset it runs on
DECISIONS: dict[str, tuple[str, str]] = {
    "vision tower": ("defaults", "vit_tower"),
    "vision rate": ("defaults", "vision_lr10"),
    "Module I batches": ("defaults", "label_batches"),
}
#: the variants a dataset runs (text-only data has no vision tower to vary)
DATASET_VARIANTS = {"emoji": tuple(VARIANTS), "reuters": ("defaults", "label_batches")}
REPORTED = ("test_P@1", "test_P@5", "test_PSP@5")


def data_of(dataset: str, work: str) -> tuple[str, list[str]]:
    """The data directory and flags of a dataset."""
    if dataset == "emoji":
        if not os.path.exists(os.path.join(EMOJI, "lbl.json.gz")):
            raise SystemExit(f"{EMOJI} holds no dataset: run python benchmarks/make_emoji.py first")
        return EMOJI, list(EMOJI_FLAGS)
    data_dir, _, flags = prepare(dataset, work)
    return data_dir, flags


def variant_flags(variant: str, work: str, seed: int) -> list[str]:
    """A variant's flags, its random ViT built (with the run's seed) where it asks for one."""
    flags = list(VARIANTS[variant][1])
    if "VIT" in flags:
        flags[flags.index("VIT")] = make_vit(os.path.join(work, f"vit-{seed}"), seed=seed)
    return flags


def aggregate(rows: list[dict]) -> list[dict]:
    """One dict per (dataset, variant) in first-seen order: its seeds and the mean of every validation and reported
    key over them (``<key>``) with its values (``<key>_values``)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["dataset"], row["variant"]), []).append(row)
    out = []
    for (dataset, variant), members in groups.items():
        agg = {"dataset": dataset, "variant": variant, "seeds": [m["seed"] for m in members],
               "wall_seconds": statistics.fmean(m["wall_seconds"] for m in members)}
        for key in (*SELECTION_KEYS, *REPORTED):
            values = [m[key] for m in members if m.get(key) is not None]
            agg[key + "_values"] = values
            agg[key] = statistics.fmean(values) if len(values) == len(members) else None
        out.append(agg)
    return out


def decisions(aggregates: list[dict]) -> dict[int, list[str]]:
    """``id(aggregate)`` -> the decisions that variant is chosen by: per decision and dataset where both of its
    variants ran, the better mean validation P@1 + PSP@5 (:func:`benchmarks.harness.chosen_by_group`)."""
    taken: dict[int, list[str]] = {}
    for name, pair in DECISIONS.items():
        members = [a for a in aggregates if a["variant"] in pair]
        both = {d for d in {a["dataset"] for a in members} if sum(a["dataset"] == d for a in members) == 2}
        for picked in chosen_by_group([a for a in members if a["dataset"] in both], "dataset"):
            taken.setdefault(picked, []).append(name)
    return taken


def cell(values: list[float]) -> str:
    """``mean ± sample std`` (:func:`benchmarks.bench_headline.spread`; "-" for no value)."""
    return spread(values) if values else "-"


def table(results: dict) -> str:
    """The decisions' table: per (dataset, variant) the seeds' mean +- std of the validation and test metrics, the
    validation objective and the chosen marks."""
    aggregates = aggregate(results["rows"])
    taken = decisions(aggregates)
    header = ["dataset", "variant", "seeds", "val P@1", "val PSP@5", "val P@1+PSP@5", "P@1", "P@5", "PSP@5", "wall s", "chosen"]
    rows = []
    for a in aggregates:
        objective = a[SELECTION_KEYS[0]] + a[SELECTION_KEYS[1]] if a[SELECTION_KEYS[0]] is not None and a[SELECTION_KEYS[1]] is not None else None
        chosen = ", ".join(f"chosen ({name})" for name in taken.get(id(a), []))
        rows.append([a["dataset"], VARIANTS[a["variant"]][0], len(a["seeds"]), *(cell(a[k + "_values"]) for k in SELECTION_KEYS),
                     "-" if objective is None else f"{objective:.2f}", *(cell(a[k + "_values"]) for k in REPORTED),
                     f"{a['wall_seconds']:.0f}", chosen])
    return markdown_table(header, rows, "ll" + "r" * 8 + "l") + "\n"


def main() -> None:
    ap = bench_parser(__doc__, result_path("mufin_defaults_validation.json"), docs_block="mufin-defaults", table_only=True)
    ap.add_argument("--datasets", nargs="+", default=list(DATASET_VARIANTS), choices=list(DATASET_VARIANTS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[42, 43, 44])
    ap.add_argument("--rerun", action="store_true", help="run rows already in --out again")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more train_mufin.py flags for every run (e.g. a smaller budget to try the script)")
    args = ap.parse_args()
    results = read_json(args.out) if os.path.exists(args.out) else {"rows": []}
    if args.table_only:
        publish(table(results), "mufin-defaults", args.update_docs)
        return
    with tempfile.TemporaryDirectory() as work:
        for dataset in args.datasets:
            data_dir, flags = data_of(dataset, work)
            for variant in (v for v in args.variants if v in DATASET_VARIANTS[dataset]):
                for seed in args.seeds:
                    done = [r for r in results["rows"] if (r["dataset"], r["variant"], r["seed"]) == (dataset, variant, seed)]
                    if done and not args.rerun:
                        continue
                    extra = [*flags, *validation_flags(data_dir), "--seed", str(seed), *variant_flags(variant, work, seed), *args.extra]
                    metrics, seconds = run_training_script("mufin", data_dir, minilm(), os.path.join(work, f"{dataset}-{variant}-{seed}"), extra)
                    row = {"dataset": dataset, "variant": variant, "seed": seed, "wall_seconds": round(seconds, 1), "commit": git_commit(),
                           "cpu": cpu_name(), "args": extra, **{k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}}
                    results["rows"] = [r for r in results["rows"] if r not in done] + [row]
                    write_json(args.out, results)  # after every run: a long sweep cut short keeps what it measured
                    print(f"{dataset} {variant} seed {seed}: " + " ".join(f"{k}={metrics.get(k, float('nan')):.2f}" for k in (*SELECTION_KEYS, *REPORTED)),
                          flush=True)
    publish(table(results), "mufin-defaults", args.update_docs)


if __name__ == "__main__":
    main()
