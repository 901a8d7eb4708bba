#!/usr/bin/env python
"""Trained encoders that carry the head on their own: each text method's dense ranking (and its fusion with the
lexical channel) per dataset and training recipe, against the best tree peer and the untrained encoder.

    python benchmarks/make_wordnet.py
    python benchmarks/bench_dense.py --datasets wordnet --methods dexml --recipes in_batch hard_negatives --update_docs
    python benchmarks/bench_dense.py --table_only --update_docs        # the table of --out, nothing run

A row is ``training_scripts/train_<method>.py`` run through the training-script contract on a dataset with the
step budget of ``bench_validation.py`` (WordNet-XMC: the 40-CPU-minute budgets of ``bench_wordnet.py``; Debtags half
an epoch, Reuters one), ``--lexical_channel omikuji`` (so the fused ranking is measured on the same model, its
weights tuned on the validation split) and the training filter file where the dataset has one; the recipe's flags
come last and win (a recipe may change the step budget, so that two recipes cost the same wall time). *Dense* is the
trained model alone (``test_dense_*``), *fused* what the script saves and reports (``test_*``). The references are
read from committed results: every tree peer (``peers_wordnet.json``, ``debtags.json``, ``peers_reuters.json``:
``python benchmarks/peers.py --dataset outputs/reuters --only omikuji omikuji_bonsai napkinxc zeroshot --out
benchmarks/results/peers_reuters.json``) and the untrained
all-MiniLM-L6-v2 with and without the channel (the ``zeroshot`` rows of ``validation_fusion.json``). Wall minutes are
the whole script on the machine it ran on (``load_1min`` says how busy it was); rows already in ``--out`` are kept
(``--rerun`` runs them again).
"""

from __future__ import annotations

import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.bench_validation import (  # noqa: E402
    BUDGETS,
    PEERS_RESULTS,
    SHOWN,
    TAIL_HEADER,
    TAIL_NOTE,
    data_setup,
    has_tail,
    metric_cell,
    pick,
    pick_tail,
    tail_cells,
)
from benchmarks.harness import (  # noqa: E402
    SELECTION_KEYS,
    bench_parser,
    chosen_by_group,
    data_version,
    dataset_cell,
    git_commit,
    markdown_table,
    publish,
    read_json,
    result_path,
    training_record,
    tuned_settings,
    write_json,
)
from benchmarks.sweep_defaults import DATA_FLAGS, minilm, run_training_script  # noqa: E402

DATASETS = ("wordnet", "debtags", "reuters")
METHODS = ("dexml", "prime", "unidec", "siamesexml")
#: one negative per query from its top 100 under the model's own index, first mined a twentieth of an epoch in
MINED = ["--hard_negatives", "1", "--hard_negative_top_k", "100", "--hard_negative_start_epoch", "0.05"]
#: DEXML's default negatives and batches: MINED, mined again every epoch, clusters of 16 from the first mining pass, on
#: any label space (``--cluster_min_labels 0``: train_dexml.py gates clustering to 10,000 labels or more since
#: 2026-11-29, so without it the recipe ran as ``hard_negatives`` on Debtags and Reuters)
DEXML_NEGATIVES = [*MINED, "--hard_negative_refresh_interval", "1", "--cluster_batching", "true", "--cluster_start_epoch", "0.05",
                   "--cluster_init_size", "16", "--cluster_curriculum_epochs", "100", "--cluster_refresh_interval", "1",
                   "--cluster_min_labels", "0"]
#: SiameseXML's Module IV as [P] trains it: the point likelihood over the 3 x |P_i| hardest shortlist negatives. Named
#: on the command line because it stopped being the script's default on 2026-11-30 (d875e9e): until 2026-12-05 the
#: recipes below left it to the defaults, so their rows from then on ran the softmax Module IV, the very objective
#: ``softmax_classifiers`` names (the "tie" of the Module IV decision on Debtags and Reuters was one configuration run twice)
PAPER_MODULE4 = ["--classifier_loss", "likelihood", "--classifier_negatives", "hardest"]
#: SiameseXML's Module I with DEXML's decoupled softmax (the ``softmax_module1`` recipe and its longer twin), with
#: [P]'s Module IV
SOFTMAX_MODULE1 = ["--siamese_loss", "softmax", "--learning_rate", "3e-4", "--label_sampling_power", "1.0", "--bf16", "true", *PAPER_MODULE4]
#: named flag sets appended to a row's command (the script's defaults fill in the rest, at the commit that ran the row)
RECIPES: dict[str, list[str]] = {
    # the script's defaults at the dataset's step budget: what bench_validation.py runs (its rows of
    # validation_fusion.json join this table under this name, :func:`validation_rows`)
    "defaults": [],
    # the defaults without NGAME cluster batching (DEXML: clusters of 16 from --cluster_min_labels 10,000 labels on, so
    # this differs from the defaults on WordNet-XMC only), the same steps: whether the gate's clustering pays there
    "no_clusters": ["--cluster_batching", "false"],
    # in-batch negatives only: the other queries' positives of the batch (train_dexml.py's default before the hard negatives)
    "in_batch": ["--hard_negatives", "0", "--cluster_batching", "false"],
    # ANCE-style negatives from the model's own index: mined a twentieth of an epoch into the run and once an epoch
    # after that (its training filter pairs excluded, in bfloat16 where the CPU has AMX), one per query from its top 100
    "hard_negatives": [*MINED, "--hard_negative_refresh_interval", "1", "--cluster_batching", "false"],
    # the same, mined again 0.15 epoch after the first mining: negatives of a model trained for a while, not of the
    # nearly untrained one of step ~75
    "hard_negatives_refreshed": [*MINED, "--hard_negative_refresh_interval", "0.15", "--cluster_batching", "false"],
    # two mined negatives per query instead of one
    "two_negatives": [*MINED, "--hard_negatives", "2", "--hard_negative_refresh_interval", "1", "--cluster_batching", "false"],
    # the default's negatives + NGAME cluster batching: clusters of 16 similar queries (4 per batch), first made from
    # the first mining pass's query vectors (a twentieth of an epoch in), re-made from the memory bank every epoch start
    "clustered": DEXML_NEGATIVES,
    # a method's own hard negatives and cluster batching (UniDEC: 6 per query from a DE-head top 30, clusters of 8),
    # started a twentieth of an epoch in instead of at the second epoch, which a short budget never reaches
    "early_start": ["--hard_negative_start_epoch", "0.05", "--cluster_start_epoch", "0.05"],
    # the same without cluster batching (the method's own hard negatives only, from a twentieth of an epoch)
    "early_negatives": ["--hard_negative_start_epoch", "0.05", "--cluster_batching", "false"],
    # a method's own cluster batching (PRIME: clusters of 8) from a twentieth of an epoch, from an encoding pass
    # over the training queries there (PRIME mines no shortlist)
    "early_clusters": ["--cluster_start_epoch", "0.05"],
    # UniDEC's classifier vectors Psi_l started from the label's text through the classifier head instead of xavier
    # noise: at a third of an epoch most of WordNet-XMC's 53K labels get few updates
    "label_text_init": ["--classifier_init", "label_text"],
    # the script's defaults with the training steps under bfloat16 autocast (--bf16 true; the mining passes are bf16
    # already where the CPU has AMX): on WordNet-XMC with the steps that fit the float32 row's wall time
    "bf16": ["--bf16", "true"],
    # DEXML's default negatives and batches (the ``clustered`` recipe: one mined negative per query from its top 100, a
    # twentieth of an epoch in, clusters of 16 from there) on another method, in bf16: UniDEC's own (6 from a DE-head top
    # 30, clusters of 8 from the second epoch) never start within a short budget and, started early, did not pay
    "dexml_mining": [*DEXML_NEGATIVES, "--bf16", "true"],
    # the same with DEXML's gate on cluster batching (only on label spaces of 10,000+ labels: it cost dense P@1 on
    # Debtags and Reuters); on WordNet-XMC's 53K labels it is dexml_mining itself
    "dexml_mining_gated": [*DEXML_NEGATIVES, "--cluster_min_labels", "10000", "--bf16", "true"],
    # the script's own budget where bench_validation.py cut it (SiameseXML on Debtags and Reuters: 2 epochs of Module I
    # and 10 of Module IV instead of 0.25 + 2 and 0.5 + 5; DEXML and PRIME on Debtags: 3 epochs instead of half; DEXML,
    # PRIME and UniDEC on Reuters: 3 epochs instead of 1), bf16
    "script_budget": ["--bf16", "true"],
    # the default (bf16) with the steps that fill the 40 wall minutes on 2 cores instead of the float32 row's 31
    "forty_minutes": ["--bf16", "true"],
    # SiameseXML's Module I with DEXML's decoupled softmax (scale 20) over the in-batch labels instead of the point
    # likelihood with one hard negative, at DEXML's rate (3e-4 for 1e-4) and labels drawn in proportion to their points
    # (power 1 for [P]'s 0.45), in bf16: the script's defaults from 2026-11-29; Module IV as [P] (PAPER_MODULE4)
    "softmax_module1": SOFTMAX_MODULE1,
    # the same with twice Module I's epochs (4 instead of the script's 2; Module IV keeps its 10): the dense Debtags
    # model was 1.3 P@1 under the tree peer after 2
    "module1_epochs4": SOFTMAX_MODULE1,
    # the softmax Module I with mined label negatives: each drawn label brings one of its 10 nearest labels (by the
    # untrained encoder's label-text vectors) into the 64-label batch, in place of a random draw
    "mined_labels": [*SOFTMAX_MODULE1, "--label_negatives_per_draw", "1"],
    # the softmax Module I with Module IV's classifiers trained by DEXML's decoupled softmax (scale 20) of each positive
    # against all of the point's 100 shortlist negatives, instead of [P]'s point likelihood over its 3 x |P_i| hardest
    "softmax_classifiers": [*SOFTMAX_MODULE1, "--classifier_loss", "softmax", "--classifier_negatives", "all"],
    # the one-GPU budget (hf_xmc.training.presets.GPU_PRESETS: batch 512, 1,200 or 900 steps, sized to ~10 minutes of
    # one H100): alone, without the dataset's CPU step budget; runs only where CUDA is available
    "gpu_preset": ["--preset", "gpu"],
}
#: the decisions the table settles on validation: per (dataset, method), recipes compared at one budget; the one with
#: the best fused validation P@1 + PSP@5 is marked ``chosen (<decision>)`` once each of them carries validation metrics
#: and at least two of them were run for that (dataset, method). A recipe may take part in several decisions; recipes
#: of none are never marked.
DECISIONS: dict[str, tuple[str, ...]] = {
    # DEXML's and UniDEC's negatives and batches: in-batch only, one mined negative a query, the same + NGAME clusters
    "negatives": ("in_batch", "hard_negatives", "clustered"),
    # SiameseXML's Module IV (both after the softmax Module I): [P]'s point likelihood over the 3 x |P_i| hardest
    # shortlist negatives, or DEXML's decoupled softmax of each positive against all of the point's 100
    "module_iv": ("softmax_module1", "softmax_classifiers"),
    # DEXML's cluster batching on a label space past --cluster_min_labels (WordNet-XMC): the defaults, or none
    "clusters": ("defaults", "no_clusters"),
}
#: the methods each decision is taken for (its recipes must give each of them different arguments: a test parses them)
DECISION_METHODS: dict[str, tuple[str, ...]] = {"negatives": ("dexml", "unidec"), "module_iv": ("siamesexml",), "clusters": ("dexml",)}


def decisions_of(recipe: str) -> tuple[str, ...]:
    """The :data:`DECISIONS` entries a recipe takes part in (none: ``()``)."""
    return tuple(name for name, recipes in DECISIONS.items() if recipe in recipes)


def chosen_decisions(rows: list[dict]) -> dict[int, list[str]]:
    """``id(row)`` -> the decisions that row's recipe is chosen by: per :data:`DECISIONS` entry and (dataset, method)
    with two or more of its recipes run, the best fused validation objective
    (:func:`benchmarks.harness.chosen_by_group`: no mark while one of them predates the validation metrics)."""
    taken: dict[int, list[str]] = {}
    for decision, recipes in DECISIONS.items():
        members = [r for r in rows if r["recipe"] in recipes]
        run = {(r["dataset"], r["method"]): {m["recipe"] for m in members if (m["dataset"], m["method"]) == (r["dataset"], r["method"])} for r in members}
        members = [r for r in members if len(run[(r["dataset"], r["method"])]) > 1]
        for picked in chosen_by_group(members, lambda r: (r["dataset"], r["method"]), metrics=lambda r: validation_objective(r, "fused")):
            taken.setdefault(picked, []).append(decision)
    return taken


#: recipes that bring their own budget (the dataset's CPU step budget of BUDGETS is not added)
OWN_BUDGET = {"gpu_preset"}
#: step budgets of a recipe that costs more per step, per dataset (None: the dataset's own budget): a hard-negative
#: step encodes 64 more labels (~1.5x an in-batch step) and a mining pass ~150K texts (~2.7 min in bfloat16), so 440
#: steps take about the wall time of the in-batch recipe's 800
#: SiameseXML's script defaults (2 Module I epochs, 10 classifier epochs), where the dataset's step budget would cut them
SIAMESEXML_SCRIPT_BUDGET = ["--num_train_epochs", "2", "--classifier_epochs", "10"]
RECIPE_BUDGETS: dict[tuple[str, ...], list[str]] = {
    ("wordnet", "hard_negatives"): ["--max_steps", "440"],
    ("wordnet", "hard_negatives_refreshed"): ["--max_steps", "380"],  # a second mining pass costs ~60 hard-negative steps
    ("wordnet", "two_negatives"): ["--max_steps", "330"],  # 128 labels more per step instead of 64 (~1.33x a one-negative step)
    ("wordnet", "clustered"): ["--max_steps", "440"],  # the clustering itself takes seconds (from the mining pass's vectors)
    # a bf16 step against a float32 one in bench_throughput.py's quiet run (throughput_bf16.json): DEXML 1.26x, UniDEC
    # 1.35x, PRIME 1.28x, SiameseXML Module I 2.13x; per method (dataset, recipe, method) before (dataset, recipe)
    ("wordnet", "bf16", "dexml"): ["--max_steps", "555"],  # the clustered default's 440 x 1.26
    ("wordnet", "bf16", "unidec"): ["--max_steps", "740"],  # 550 x 1.35
    ("wordnet", "bf16", "prime"): ["--max_steps", "830"],  # 650 x 1.28
    # UniDEC's pool (capped at 256) full from the first mining on (the default's 740 reach negatives only after an
    # epoch, ~570 steps), and one mining pass more: ~15% more per step and ~3 minutes
    ("wordnet", "dexml_mining", "unidec"): ["--max_steps", "620"],
    # 555 bf16 steps took 1,304 s of training (2.06 s a step + one ~160 s mining pass) in 1,718 s of wall time; 800
    # steps cross the first epoch (570 steps): a second mining pass and re-clustering
    ("wordnet", "forty_minutes", "dexml"): ["--max_steps", "800"],
    # the script's own epochs where the dataset's flags cut them to half an epoch (DEXML / PRIME: 3 epochs; PRIME's
    # (W) stage keeps its 10)
    ("debtags", "script_budget", "dexml"): ["--num_train_epochs", "3"],
    ("debtags", "script_budget", "prime"): ["--num_train_epochs", "3"],
    # on Reuters too (the dataset's flags give one epoch): DEXML, PRIME and UniDEC at their scripts' 3 epochs
    **{("reuters", "script_budget", method): ["--num_train_epochs", "3"] for method in ("dexml", "prime", "unidec")},
    ("debtags", "module1_epochs4", "siamesexml"): ["--num_train_epochs", "4", "--classifier_epochs", "10"],
    ("reuters", "module1_epochs4", "siamesexml"): ["--num_train_epochs", "4", "--classifier_epochs", "10"],
    # every other SiameseXML recipe on the two small datasets: the script's own 2 Module I + 10 classifier epochs
    **{(dataset, recipe, "siamesexml"): SIAMESEXML_SCRIPT_BUDGET for dataset in ("debtags", "reuters")
       for recipe in ("script_budget", "softmax_module1", "mined_labels", "softmax_classifiers")},
}
TRAIN_FILTERS = {"wordnet": "filter_labels_train.txt"}


BUDGET_FLAGS = ("--num_train_epochs", "--max_steps", "--per_device_train_batch_size")


def without_budget(flags: list[str]) -> list[str]:
    """``flags`` without their budget and batch flags (:data:`BUDGET_FLAGS` and each one's value): given on the command
    line they would win over a preset's."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in BUDGET_FLAGS:
            skip = True
        else:
            out.append(flag)
    return out


def row_flags(dataset: str, method: str, recipe: str) -> list[str]:
    """The flags a row adds after the dataset's own (the last occurrence wins, as on the command line): the method's
    step budget on that dataset (unless the recipe brings its own), the recipe's flags, then the recipe's budget."""
    return [*([] if recipe in OWN_BUDGET else BUDGETS.get((dataset, method), [])), *RECIPES[recipe],
            *RECIPE_BUDGETS.get((dataset, recipe, method), RECIPE_BUDGETS.get((dataset, recipe), []))]


def run_row(dataset: str, method: str, recipe: str, work: str) -> dict:
    """Train through the script (``run_training_script``) and keep what its eval_results.json says."""
    data_dir, data_flags = data_setup(dataset, work)
    if recipe in OWN_BUDGET:  # the recipe's budget and batch (--preset gpu's 512), not the dataset's CPU ones
        data_flags = without_budget(data_flags)
    if dataset in TRAIN_FILTERS:
        data_flags = [*data_flags, "--train_filter_file", os.path.join(data_dir, TRAIN_FILTERS[dataset])]
    import torch

    if recipe == "gpu_preset" and not torch.cuda.is_available():
        raise SystemExit("bench_dense.py: the gpu_preset recipe is sized for one GPU and needs CUDA; this machine has none")
    flags = row_flags(dataset, method, recipe)
    out = os.path.join(work, f"{dataset}-{method}-{recipe}")
    results, wall = run_training_script(method, data_dir, minilm(), out, [*data_flags, "--seed", "42", "--lexical_channel", "omikuji", *flags])
    commit = git_commit()
    return {"row": f"{dataset}-{method}-{recipe}", "dataset": dataset, "data_version": data_version(dataset, data_dir), "method": method,
            "recipe": recipe, "flags": flags,
            "commit": commit, "wall_seconds": round(wall, 1), "load_1min": round(os.getloadavg()[0], 2),
            "train_runtime": results.get("train_runtime"), "dense": pick(results, "test_dense_"), "fused": pick(results, "test_"),
            # the final model on the run's validation split: what choosing a default reads (benchmarks.harness.choose)
            "validation_dense": pick(results, "eval_dense_"), "validation_fused": pick(results, "eval_"),
            "weights": [results.get("lexical_ranker_weight"), results.get("lexical_text_weight")],
            # the model's own ranking settings tuned on the validation split (SiameseXML's classifier share, ...)
            "tuned": tuned_settings(results),
            # what --bf16 auto / --mining_precision auto resolved to, and the passes that only picked training examples
            "train": training_record(results),
            "tail": pick_tail(results)}  # coverage, seen / unseen, deciles of both rankings (bench_validation.TAIL_HEADER)


def references(dataset: str) -> list[tuple[str, dict, str | None]]:
    """Every tree peer (none is picked by a test metric: the peers run no validation split) and the untrained encoder
    (dense, + channel) of ``dataset`` from committed results: ``(name, metrics, data version)``."""
    refs = []
    peers_file = PEERS_RESULTS.get(dataset)
    if peers_file and os.path.exists(result_path(peers_file)):
        result = read_json(result_path(peers_file))
        rows = [r for r in result["rows"] if "hf_xmc" not in r["method"] and "zero-shot" not in r["method"]]
        refs += [(f"tree peer: {r['method']}", r["metrics"], result.get("data_version")) for r in rows]
    validation = result_path("validation_fusion.json")
    zeroshot = next((r for r in read_json(validation) if r["row"] == f"{dataset}-zeroshot"), None) if os.path.exists(validation) else None
    if zeroshot:
        version = zeroshot.get("data_version")
        refs += [("untrained all-MiniLM-L6-v2, dense", zeroshot["dense"], version), ("untrained all-MiniLM-L6-v2 + channel", zeroshot["fused_now"], version)]
    return refs


#: the recipe each training script runs without flags (its defaults) on this AMX CPU, per method and dataset: bf16
#: steps (--bf16 auto) on top of DEXML's cluster batching from --cluster_min_labels 10,000 labels on (WordNet-XMC;
#: not on Debtags' 597 or Reuters' 90) and UniDEC's label-text classifier start from 10,000 labels on
#: (--classifier_init auto). A pair listed here without a bf16 row ran float32: its validation_fusion.json row is
#: the defaults before
SCRIPT_DEFAULTS = {(method, dataset): "bf16" for method in METHODS for dataset in DATASETS}
SCRIPT_DEFAULTS.update({("dexml", "wordnet"): "forty_minutes", ("unidec", "wordnet"): "dexml_mining", ("unidec", "debtags"): "dexml_mining_gated",
                        # SiameseXML's Module I softmax (2026-11-29/30), then its Module IV softmax over all shortlist negatives
                        # (2026-11-30): dense P@1 above the softmax_module1 rows on all three datasets
                        ("siamesexml", "reuters"): "softmax_classifiers", ("siamesexml", "debtags"): "softmax_classifiers", ("siamesexml", "wordnet"): "softmax_classifiers",
                        ("dexml", "debtags"): "script_budget", ("prime", "debtags"): "script_budget",
                        # the scripts' 3 epochs on Reuters (the rows at the dataset's one epoch stay as comparisons)
                        ("dexml", "reuters"): "script_budget", ("prime", "reuters"): "script_budget", ("unidec", "reuters"): "script_budget"})


def budget(dataset: str, flags: list[str]) -> str:
    """The row's training budget: its flags after the dataset's (``DATA_FLAGS``; the last occurrence wins, as on the
    command line), steps before epochs (``--max_steps`` overrides the epochs)."""
    flags = [*DATA_FLAGS.get(dataset, []), *flags]

    def last(*names: tuple[str, str]) -> str:
        for flag, unit in names:
            at = max((i for i, f in enumerate(flags) if f == flag), default=None)
            if at is not None:
                value = flags[at + 1]
                return f"{value} {unit.rstrip('s') if float(value) == 1 else unit}"
        return ""

    if "gpu" in flags:  # --preset gpu: its steps of 512 (hf_xmc.training.presets.GPU_PRESETS)
        return "--preset gpu (1,200 / 900 steps of 512)"
    main = last(("--max_steps", "steps"), ("--num_train_epochs", "epochs")) or "script's epochs"
    stage2 = last(("--classifier_max_steps", "classifier steps"), ("--classifier_epochs", "classifier epochs"))  # SiameseXML
    return f"{main} + {stage2}" if stage2 else main


def validation_rows(rows: list[dict]) -> list[dict]:
    """The other methods' rows of ``validation_fusion.json`` (their scripts' defaults at the commit that ran them, the
    same step budgets, the same channel), as rows of this table (recipe ``defaults``), beside what this benchmark ran;
    DEXML's too where this benchmark has no row of DEXML's defaults on that dataset version (WordNet-XMC v2; its other
    recipes there, ``no_clusters``, are compared with it)."""
    path = result_path("validation_fusion.json")
    if not os.path.exists(path):
        return []
    ours = {(r["dataset"], r.get("data_version")) for r in rows
            if r["method"] == "dexml" and r["recipe"] in ("defaults", SCRIPT_DEFAULTS.get(("dexml", r["dataset"])))}
    return [{**r, "recipe": "defaults", "fused": r["fused_now"]} for r in read_json(path)
            if r["method"] in METHODS and (r["method"] != "dexml" or (r["dataset"], r.get("data_version")) not in ours)]


def chosen_cell(decisions: list[str]) -> str:
    """The ``by val`` cell of a row decisions take: ``chosen (<decision>, ...)``."""
    return f"chosen ({', '.join(decisions)})"


def validation_objective(row: dict, ranking: str) -> dict:
    """A row's validation metrics of one ranking under the selection keys (``eval_P@1``, ...; {} for a row run before
    the scripts reported them), for :func:`benchmarks.harness.chosen_by_group`."""
    measured = row.get(f"validation_{ranking}") or {}
    return {key: measured[key[len("eval_"):]] for key in SELECTION_KEYS if key[len("eval_"):] in measured}


def table(rows: list[dict]) -> str:
    """Per dataset: the references (every tree peer, the untrained encoder), then per method and recipe the dense and
    fused rankings' test metrics. ``val P@1+PSP@5`` is the same ranking's objective on the run's validation split, and
    ``by val`` marks the recipe a decision takes per (dataset, method) and :data:`DECISIONS` entry: the best fused
    validation objective (rows run before the scripts reported it show "-", and a group with such a row gets no mark;
    :func:`chosen_decisions`)."""
    header = ["dataset", "model", "recipe", "budget", "ranking", *SHOWN, "val P@1+PSP@5", "by val", "wall min"]
    cells = []
    rows = rows + validation_rows(rows)
    recipes = ["defaults", *RECIPES]
    chosen = chosen_decisions(rows)
    for dataset in DATASETS:
        ours = sorted((r for r in rows if r["dataset"] == dataset), key=lambda r: (METHODS.index(r["method"]), recipes.index(r["recipe"])))
        if not ours:
            continue
        for name, metrics, version in references(dataset):
            cells.append([dataset_cell(dataset, version), name, "", "", "", *(metric_cell(dataset, metrics, m) for m in SHOWN), "", "", ""])
        if not any(r["recipe"] == "gpu_preset" for r in ours):  # the issue asks the table to say so
            cells.append([dataset, "every text method", "gpu_preset", budget(dataset, RECIPES["gpu_preset"]),
                          "not measured: no GPU was lent to the sessions so far", *([""] * len(SHOWN)), "", "", ""])
        for r in ours:
            recipe = r["recipe"] + (" (default)" if SCRIPT_DEFAULTS.get((r["method"], dataset)) == r["recipe"] else "")
            if r["recipe"] == "defaults":  # the defaults of validation_fusion.json's commit, unless a recipe here is the default now
                # a row measured since the scripts report validation metrics (2026-12-04) ran today's defaults
                before = (r["method"], dataset) in SCRIPT_DEFAULTS and not r.get("validation_fused")
                recipe = f"script's defaults{' before' if before else ''} (validation_fusion.json)"
            for ranking in ("dense", "fused"):
                objective = validation_objective(r, ranking)
                cells.append([dataset_cell(dataset, r.get("data_version")), r["method"], recipe, budget(dataset, r["flags"]), ranking, *(metric_cell(dataset, r[ranking], m) for m in SHOWN),
                              f"{sum(objective.values()):.2f}" if len(objective) == len(SELECTION_KEYS) else "-",
                              chosen_cell(chosen[id(r)]) if ranking == "fused" and id(r) in chosen else "", f"{r['wall_seconds'] / 60:.1f}"])
    rendered = markdown_table(header, cells, "lllll" + "r" * (len(SHOWN) + 1) + "lr") + "\n"
    if has_tail(rows):  # once rows carry them (results measured before render as they did)
        rendered += "\n" + TAIL_NOTE + "\n\n" + tail_table(rows) + "\n"
    return rendered


def tail_table(rows: list[dict]) -> str:
    """Per dataset, the tail metrics (``bench_validation.TAIL_HEADER``) of the untrained encoder (dense, + channel: the
    ``zeroshot`` row of ``validation_fusion.json``) and of both rankings of every row; "-" where a row predates them."""
    recipes = ["defaults", *RECIPES]
    validation = result_path("validation_fusion.json")
    measured = read_json(validation) if os.path.exists(validation) else []
    cells = []
    for dataset in DATASETS:
        ours = sorted((r for r in rows if r["dataset"] == dataset), key=lambda r: (METHODS.index(r["method"]), recipes.index(r["recipe"])))
        if not ours:
            continue
        row = next((r for r in measured if r["row"] == f"{dataset}-zeroshot"), None)
        if row is not None:
            zeroshot = row.get("tail", {})
            cells += [[dataset_cell(dataset, row.get("data_version")), "untrained all-MiniLM-L6-v2", "", ranking, *tail_cells(zeroshot.get(key), zeroshot.get("fused"))]
                      for ranking, key in (("dense", "dense"), ("+ channel", "fused"))]
        for r in ours:
            tail = r.get("tail", {})
            cells += [[dataset_cell(dataset, r.get("data_version")), r["method"], r["recipe"], ranking, *tail_cells(tail.get(ranking), tail.get("fused"))] for ranking in ("dense", "fused")]
    return markdown_table(["dataset", "model", "recipe", "ranking", *TAIL_HEADER], cells, "llll" + "r" * (len(TAIL_HEADER) - 1) + "l")


def main(argv=None) -> list[dict]:
    ap = bench_parser(__doc__, result_path("dense.json"), docs_block="dense", table_only=True)
    ap.add_argument("--datasets", nargs="+", default=["wordnet"], choices=list(DATASETS))
    ap.add_argument("--methods", nargs="+", default=["dexml"], choices=list(METHODS))
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--rerun", action="store_true", help="run rows already in --out again")
    args = ap.parse_args(argv)
    rows = read_json(args.out) if os.path.exists(args.out) else []
    if not args.table_only:
        with tempfile.TemporaryDirectory(prefix="dense_") as work:
            for dataset in args.datasets:
                for method in args.methods:
                    for recipe in args.recipes:
                        name = f"{dataset}-{method}-{recipe}"
                        if any(r["row"] == name for r in rows) and not args.rerun:
                            continue
                        row = run_row(dataset, method, recipe, work)
                        rows = [r for r in rows if r["row"] != name] + [row]
                        write_json(args.out, rows, sort_keys=False)
                        print(f"{name}: dense {row['dense']} fused {row['fused']} ({row['wall_seconds'] / 60:.1f} min)", flush=True)
    publish(table(rows), "dense", args.update_docs)
    return rows


if __name__ == "__main__":
    main()
