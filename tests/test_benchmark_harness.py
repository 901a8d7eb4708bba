"""benchmarks/harness.py: the docs-block update and the table renderer every benchmark script uses, and the docs'
benchmark tables being exactly what their scripts render from the committed results (none typed by hand)."""

import json
import os
import re
import stat

import pytest

from benchmarks import harness
from benchmarks.harness import docs_marker, markdown_table, read_json, replace_block, result_path, update_docs_block

PAGE = """# A page

<!-- bench:demo -->
| old |
|---|
<!-- bench:demo -->

Text after, naming the <!-- bench:demo --> block inside a line: a mention, not a marker.
"""


def test_replace_block_writes_the_body_between_the_markers_and_nothing_else(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PAGE, encoding="utf-8")
    os.chmod(page, 0o644)
    replace_block(str(page), docs_marker("demo"), "| new |\n|---:|\n| 1 |\n\n")  # trailing blank lines trimmed to one newline
    before, _, after = PAGE.partition("| old |\n|---|\n")
    assert page.read_text(encoding="utf-8") == before + "| new |\n|---:|\n| 1 |\n" + after
    assert stat.S_IMODE(os.stat(page).st_mode) == 0o644  # the temp file's private mode does not replace the page's
    assert [p.name for p in tmp_path.iterdir()] == ["page.md"]  # no temp file left beside it


@pytest.mark.parametrize("text, found", [("# no block here\n", "no"), ("<!-- bench:demo -->\n| t |\n", "1 (not 2)")])
def test_replace_block_refuses_a_file_without_exactly_two_markers(tmp_path, text, found):
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"holds {found} <!-- bench:demo --> lines")):
        replace_block(str(page), docs_marker("demo"), "| x |\n")
    assert page.read_text(encoding="utf-8") == text


def test_update_docs_block_writes_every_file_that_holds_the_block_and_fails_when_none_does(tmp_path):
    readme, page, other = tmp_path / "README.md", tmp_path / "page.md", tmp_path / "other.md"
    readme.write_text("intro\n<!-- bench:demo -->\nstale copy\n<!-- bench:demo -->\n", encoding="utf-8")
    page.write_text(PAGE, encoding="utf-8")
    other.write_text("nothing to see\n", encoding="utf-8")
    files = [str(readme), str(page), str(other)]
    assert update_docs_block("demo", "| fresh |\n", files) == [str(readme), str(page)]
    assert readme.read_text(encoding="utf-8") == "intro\n<!-- bench:demo -->\n| fresh |\n<!-- bench:demo -->\n"
    assert "<!-- bench:demo -->\n| fresh |\n<!-- bench:demo -->" in page.read_text(encoding="utf-8")
    assert other.read_text(encoding="utf-8") == "nothing to see\n"
    with pytest.raises(ValueError, match="no block <!-- bench:missing -->"):
        update_docs_block("missing", "| x |\n", files)
    other.write_text("<!-- bench:demo -->\nhalf a block\n", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"lines, not 2, in {other} (1)")):
        update_docs_block("demo", "| newer |\n", files)
    assert "| fresh |" in readme.read_text(encoding="utf-8")  # checked before writing: no file half updated


def test_markdown_table_aligns_columns_and_writes_blank_and_empty_cells():
    table = markdown_table(["model", "P@1", "note"], [["a", "1.00", ""], ["b", 2, None]], "lrl")
    assert table == "| model | P@1 | note |\n|---|---:|---|\n| a | 1.00 |  |\n| b | 2 | |"
    with pytest.raises(ValueError, match="a row of 2 cells under 3 columns"):
        markdown_table(["a", "b", "c"], [["1", "2"]])
    with pytest.raises(ValueError, match="align"):
        markdown_table(["a", "b"], [], "l")


def _blocks() -> dict:
    """Every docs block: its results file and the render its script publishes (``--table_only`` prints the same)."""
    from benchmarks import (
        bench_calibration_depth,
        bench_classifier_stage,
        bench_cold_load,
        bench_debtags,
        bench_dense,
        bench_dexml_modes,
        bench_headline,
        bench_index,
        bench_mufin,
        bench_mufin_defaults,
        bench_new_labels,
        bench_peft,
        bench_scale,
        bench_serving,
        bench_siamesexml_module1,
        bench_space_load,
        bench_static_encoder,
        bench_static_fit,
        bench_throughput,
        bench_train_filter,
        bench_unidec_memory,
        bench_validation,
        bench_wordnet,
        peers,
        sweep_defaults,
    )

    def modes(result):
        return sweep_defaults.modes_table(result, "MiniLM-L6, lr 3e-4")

    return {
        "peft": ("peft.json", lambda r: bench_peft.peft_table(r["rows"])),
        "classifier-stage": ("classifier_stage.json", lambda r: bench_classifier_stage.classifier_stage_table(r["rows"])),
        "debtags": ("debtags.json", bench_debtags.debtags_table),
        "dexml-modes": ("dexml_modes.json", bench_dexml_modes.dexml_modes_table),
        "index_scale": ("index_scale.json", lambda r: bench_index.index_table(r["results"])),
        "mufin": ("mufin.json", bench_mufin.mufin_table),
        "mufin-defaults": ("mufin_defaults_validation.json", bench_mufin_defaults.table),
        "new-labels": ("new_labels.json", lambda r: bench_new_labels.new_labels_table(r["rows"])),
        "prime": ("prime.json", modes),
        "prime-ablation-reuters": ("prime_ablation_reuters.json", modes),
        "prime-modes": ("prime_modes.json", modes),
        "prime-ablation-debtags": ("prime_ablation_debtags.json", modes),
        "unidec": ("unidec.json", modes),
        "unidec-heads": ("unidec_heads.json", modes),
        "unidec-batching": ("unidec_batching.json", modes),
        "unidec_memory": ("unidec_memory.json", bench_unidec_memory.unidec_memory_table),
        "scale": ("scale.json", bench_scale.format_table),
        "scale-gpu": ("scale_gpu.json", bench_scale.format_table),
        "serving": ("serving.json", bench_serving.table),
        "serving_ranker": ("serving_ranker.json", bench_serving.ranker_table),
        "space-load": ("space_load.json", bench_space_load.space_load_table),
        "throughput": ("throughput.json", bench_throughput.throughput_tables),
        "validation_fusion": ("validation_fusion.json", bench_validation.tables),
        "train_filter": ("train_filter.json", bench_train_filter.table),
        "dense": ("dense.json", bench_dense.table),
        "siamesexml_module1": ("siamesexml_module1.json", bench_siamesexml_module1.table),
        "validation_reliability": ("validation_fusion.json", bench_validation.reliability),
        "tail": ("validation_fusion.json", bench_validation.tail_overview),
        "calibration_depth": ("calibration_depth.json", bench_calibration_depth.table),
        "wordnet_quality": ("wordnet_quality.json", bench_wordnet.table),
        "peers_wordnet": ("peers_wordnet.json", lambda r: peers.peers_table(r["rows"])),
        "headline": ("headline.json", bench_headline.table),
        "static": ("static_encoder.json", bench_static_encoder.static_table),
        "static-fit": ("static_fit.json", bench_static_fit.table),
        "cold_load": ("cold_load.json", bench_cold_load.table),
    }


def test_every_docs_block_is_its_script_render_of_the_committed_results():
    blocks = _blocks()
    found = set()
    for path in harness.doc_files():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for name in set(re.findall(r"^<!-- bench:(\S+) -->$", text, flags=re.M)):
            found.add(name)
            assert name in blocks, f"{path}: block {name} has no renderer here (add it to _blocks)"
            results, render = blocks[name]
            body = text.split(f"\n{docs_marker(name)}\n")[1]
            expected = render(read_json(result_path(results))).rstrip("\n") + "\n"
            assert body + "\n" == expected, f"{os.path.relpath(path, harness.REPO)}: block {name} differs from its render of {results}"
    assert found == set(blocks)


def test_the_readme_lora_table_is_the_peft_page_block():
    def block(path):
        with open(path, encoding="utf-8") as f:
            return f.read().split(f"\n{docs_marker('peft')}\n")[1]

    readme, page = (os.path.join(harness.REPO, *p) for p in (("README.md",), ("docs", "peft.md")))
    assert block(readme) == block(page) and "| debtags | dexml | lora-r8 |" in block(readme)


def test_alternating_step_seconds_gives_each_setting_the_mean_of_its_own_steps_after_warm_up():
    from benchmarks.bench_throughput import alternating_step_seconds, step_seconds

    # step k ran setting k % 2: setting 0 takes 1 s, setting 1 takes 3 s; the first two steps of each are slow warm-up
    durations = [9.0, 9.0, 9.0, 9.0] + [1.0, 3.0] * 5
    times = [0.0]
    for d in durations[1:]:
        times.append(times[-1] + d)
    assert alternating_step_seconds(times, 2, warmup=2) == [1.0, 3.0]
    # one warm-up step each keeps steps 2 and 3 (9 s) in the means: (9 + 5 x 1) / 6 and (9 + 5 x 3) / 6
    assert alternating_step_seconds(times, 2, warmup=1) == [14 / 6, 24 / 6]
    # step_seconds times from the end of step ``warmup`` on: from the end of step 3, ten steps of 1 and 3 s
    assert step_seconds(times, 3) == 2.0


# ------------------------------------------------------------------------------------------------ choosing on validation
def test_choose_reads_the_validation_split_and_refuses_a_test_key():
    # test favours "a", validation favours "b": the choice is "b"
    rows = [{"name": "a", "eval_P@1": 50.0, "eval_PSP@5": 20.0, "test_P@1": 70.0, "test_PSP@5": 40.0},
            {"name": "b", "eval_P@1": 52.0, "eval_PSP@5": 21.0, "test_P@1": 60.0, "test_PSP@5": 30.0}]
    assert harness.choose(rows)["name"] == "b"
    assert harness.selection_score(rows[0]) == 70.0
    with pytest.raises(ValueError, match="validation metrics"):
        harness.choose(rows, keys=("test_P@1",))
    with pytest.raises(ValueError, match="no validation split"):
        harness.choose([{"name": "old", "test_P@1": 1.0}])


def test_chosen_by_group_picks_one_row_per_group_and_skips_groups_measured_without_validation():
    rows = [{"dataset": "x", "eval_P@1": 1.0, "eval_PSP@5": 1.0}, {"dataset": "x", "eval_P@1": 2.0, "eval_PSP@5": 0.5},
            {"dataset": "y", "eval_P@1": 9.0, "eval_PSP@5": 9.0}, {"dataset": "y", "test_P@1": 99.0}]
    assert harness.chosen_by_group(rows, "dataset") == {id(rows[1])}
    assert harness.chosen_by_group(rows[:2], lambda r: "all") == {id(rows[1])}


def _key_constants(node):
    """String constants of the ``key=`` argument of a max / min / sorted call (the code that picks a row)."""
    import ast

    if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("max", "min", "sorted"):
        for kw in node.keywords:
            if kw.arg == "key":
                yield from (c.value for c in ast.walk(kw.value) if isinstance(c, ast.Constant) and isinstance(c.value, str))


def test_no_benchmark_script_picks_a_row_by_a_test_metric():
    """Every choice in benchmarks/ goes through harness.choose (validation keys only): no max / min / sorted keyed by a
    metric name (``P@1``, ``test_PSP@5``, ...), and every selection-key list names eval_ keys only."""
    import ast
    import glob

    metric = re.compile(r"^(test_|test_dense_)?(P|PSP|nDCG|PSnDCG|R)@\d+$")
    offenders = []
    for path in sorted(glob.glob(os.path.join(harness.REPO, "benchmarks", "*.py"))):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            offenders += [f"{os.path.basename(path)}:{node.lineno} key reads {c!r}" for c in _key_constants(node) if metric.match(c)]
    assert not offenders, offenders
    from benchmarks import sweep_defaults

    assert all(k.startswith("eval_") for k in harness.SELECTION_KEYS) and sweep_defaults.CHOSEN_BY == list(harness.SELECTION_KEYS)


def test_the_key_scan_catches_a_choice_by_a_test_metric():
    import ast

    tree = ast.parse('best = max(rows, key=lambda r: r["metrics"]["P@1"])\nlast = sorted(rows, key=lambda r: r["test_PSP@5"])')
    found = [c for node in ast.walk(tree) for c in _key_constants(node)]
    assert sorted(found) == ["P@1", "metrics", "test_PSP@5"]


def test_a_sweep_table_marks_the_validation_choice_not_the_test_winner():
    from benchmarks import sweep_defaults

    base = {f"test_{k[5:]}": 1.0 for k in sweep_defaults.BENCH_SHOWN}
    rows = [{**base, "description": "test winner", "dataset": "debtags", "batch_size": "64", "wall_seconds": 1.0,
             "test_P@1": 90.0, "eval_P@1": 10.0, "eval_PSP@5": 10.0},
            {**base, "description": "validation winner", "dataset": "debtags", "batch_size": "64", "wall_seconds": 1.0,
             "test_P@1": 50.0, "eval_P@1": 30.0, "eval_PSP@5": 10.0},
            {**base, "description": "old row", "dataset": "reuters", "batch_size": "32", "wall_seconds": 1.0}]
    lines = sweep_defaults.modes_table({"epochs": "1", "rows": rows}, "t").splitlines()
    marked = [line for line in lines if "| chosen |" in line]
    assert len(marked) == 1 and "validation winner" in marked[0]
    assert "| - | - |" in next(line for line in lines if "old row" in line)


# ------------------------------------------------------------------------------------------------ tail metrics (issue 65, 6)
def _tail_results() -> dict:
    """An eval_results.json with the evaluator's tail keys (XMCEvaluator.tail_metrics), for both rankings."""
    fused = {"coverage@5": 61.234, "seen_P@5": 20.0, "unseen_P@5": 1.5, "seen_PSP@5": 40.0, "unseen_PSP@5": 12.5,
             **{f"P@5_decile{d}": float(d) for d in range(1, 11)}}
    data = {"unseen_labels": 1234, "unseen_positive_share": 9.0, "unseen_PSP@5_mass": 31.04}
    return {"test_P@1": 50.0, **{f"test_{k}": v for k, v in {**fused, **data}.items()},
            "test_dense_coverage@5": 55.0, "test_dense_unseen_PSP@5": 20.0}


def test_tail_metrics_are_kept_in_the_rows_and_rendered_beside_older_rows_as_dashes(monkeypatch, tmp_path):
    from benchmarks import bench_dense, bench_validation

    # the table alone, without the committed results it reads its references and other methods' rows from
    monkeypatch.setattr(bench_dense, "result_path", lambda name: str(tmp_path / name))

    tail = bench_validation.pick_tail(_tail_results())
    assert tail["fused"]["unseen_PSP@5_mass"] == 31.04 and tail["fused"]["P@5_decile10"] == 10.0
    assert tail["dense"] == {"coverage@5": 55.0, "unseen_PSP@5": 20.0}  # the split's own counts only once, under fused
    assert bench_validation.pick_tail({"test_P@1": 1.0}) == {"fused": {}, "dense": {}}  # a script from before
    shown = {m: 1.0 for m in bench_validation.SHOWN}
    deciles = " / ".join(f"{d:.1f}" for d in range(1, 11))
    fused_cells = "| 1,234 (31.0 %) | 61.23 | 20.00 | 1.50 | 40.00 | 12.50 | " + deciles + " |"
    dense_cells = "| 1,234 (31.0 %) | 55.00 | - | - | - | 20.00 | - |"
    dashes = "| - | - | - | - | - | - | - |"

    new = {"row": "debtags-dexml-bf16", "dataset": "debtags", "method": "dexml", "recipe": "bf16", "flags": [], "wall_seconds": 60.0,
           "dense": shown, "fused": shown, "tail": tail}
    old = {k: v for k, v in new.items() if k != "tail"} | {"row": "debtags-prime-bf16", "method": "prime"}
    assert bench_validation.TAIL_NOTE not in bench_dense.table([old])  # results without them render as before
    lines = bench_dense.table([new, old]).splitlines()
    assert bench_validation.TAIL_NOTE in lines
    assert "| debtags | dexml | bf16 | fused " + fused_cells in lines
    assert "| debtags | dexml | bf16 | dense " + dense_cells in lines
    assert "| debtags | prime | bf16 | fused " + dashes in lines and "| debtags | prime | bf16 | dense " + dashes in lines

    row = {"row": "debtags-dexml", "dataset": "debtags", "method": "dexml", "wall_seconds": 60.0, "dense": shown, "channel_alone": shown,
           "fused_before": shown, "weights_before": [1, 0.1], "fused_now": shown, "weights_now": [1, 0.1],
           "ece": {"isotonic": 1.0, "platt": 2.0}, "tail": tail}
    before = {k: v for k, v in row.items() if k != "tail"} | {"row": "debtags-prime", "method": "prime"}
    assert bench_validation.TAIL_NOTE not in bench_validation.tables([before])
    lines = bench_validation.tables([row, before]).splitlines()
    assert "| debtags | DEXML | fused now (tuned on validation) " + fused_cells in lines
    assert "| debtags | DEXML | dense " + dense_cells in lines
    assert "| debtags | PRIME | fused now (tuned on validation) " + dashes in lines


def test_the_headline_table_gives_each_ranking_its_mean_and_sample_std_over_the_seeds():
    from benchmarks import bench_headline

    def run(seed, dense, fused, model="dexml", bf16=None):
        return {"dataset": "debtags", "model": model, "seed": seed, "budget": "1 epoch", "train_minutes": 10.0, "predict_ms": 4.0,
                "dense": {"P@1": dense, "P@5": 40.0, "PSP@5": 60.0}, "fused": {"P@1": fused, "P@5": 41.0, "PSP@5": 61.0},
                **({} if bf16 is None else {"train": {"train_bf16": bf16}})}

    rows = [run(42, 90.0, 91.0), run(43, 92.0, 91.0), run(44, 91.0, 94.0), run(42, 90.0, 91.0, "unidec", 1), run(43, 90.0, 91.0, "unidec", 0),
            {"dataset": "debtags", "model": "Omikuji", "seed": 42, "budget": "library defaults", "train_minutes": 0.1, "predict_ms": 0.1,
             "peer": {"P@1": 90.3, "P@5": 47.6, "PSP@5": 68.8}}]
    lines = bench_headline.table(rows).splitlines()
    dense = next(line for line in lines if "| dense |" in line)
    fused = next(line for line in lines if "| fused |" in line)
    assert "| 42, 43, 44 | 91.00 ± 1.00 | 40.00 ± 0.00 |" in dense  # mean 91, sample std 1 (not the population's 0.82)
    assert "| 92.00 ± 1.73 |" in fused and "| 10.00 ± 0.00 | not recorded |" in fused  # rows from before the precision was kept
    # what the training ran in, per model: train minutes compare only within one precision
    assert "| unidec | dense | 42, 43 | 90.00 ± 0.00 | 40.00 ± 0.00 | 60.00 ± 0.00 | 10.00 ± 0.00 | bf16 / float32 |" in bench_headline.table(rows)
    assert "| Omikuji |  | 42 | 90.30 | 47.60 | 68.80 | 0.10 |  | 0.10 | library defaults |" in bench_headline.table(rows)


def test_mufins_defaults_are_decided_by_the_seeds_mean_validation_objective_per_dataset_not_by_test():
    from benchmarks import bench_mufin_defaults as md

    def run(dataset, variant, seed, val, test):
        return {"dataset": dataset, "variant": variant, "seed": seed, "wall_seconds": 60.0,
                "eval_P@1": val, "eval_PSP@5": 10.0, "test_P@1": test, "test_P@5": 5.0, "test_PSP@5": 7.0}

    rows = [run("emoji", "defaults", 42, 40.0, 30.0), run("emoji", "defaults", 43, 44.0, 30.0),
            # one lucky seed: the best single validation run, but the lower mean (38 against 42)
            run("emoji", "vit_tower", 42, 50.0, 60.0), run("emoji", "vit_tower", 43, 26.0, 60.0),
            run("emoji", "label_batches", 42, 45.0, 10.0), run("emoji", "label_batches", 43, 45.0, 10.0),
            run("reuters", "defaults", 42, 80.0, 90.0),  # the alternative did not run there: no mark on Reuters
            {"dataset": "emoji", "variant": "vision_lr10", "seed": 42, "wall_seconds": 1.0, "test_P@1": 99.0}]  # no validation split
    aggregates = md.aggregate(rows)
    taken = {(a["dataset"], a["variant"]): names for a in aggregates for i, names in md.decisions(aggregates).items() if i == id(a)}
    assert taken == {("emoji", "defaults"): ["vision tower"], ("emoji", "label_batches"): ["Module I batches"]}
    lines = md.table({"rows": rows}).splitlines()
    vit = next(line for line in lines if "ViT" in line)
    assert "| emoji | a random small ViT for the ResNet | 2 | 38.00 ± 16.97 | 10.00 ± 0.00 | 48.00 | 60.00 ± 0.00 |" in vit
    assert "chosen" not in vit and "| - | 99.00 |" in next(line for line in lines if "10x" in line)


def test_the_fusion_invariant_is_checked_on_the_validation_split_once_rows_carry_it():
    from benchmarks import bench_validation

    zeroshot = {"fused_now": {"P@1": 50.0, "PSP@5": 40.0}, "validation_fused": {"P@1": 52.0, "PSP@5": 41.0}}
    row = {"dense": {"P@1": 45.0, "PSP@5": 30.0}, "fused_now": {"P@1": 55.0, "PSP@5": 42.0},
           "validation_dense": {"P@1": 47.0, "PSP@5": 31.0}, "validation_fused": {"P@1": 51.0, "PSP@5": 43.0}}
    assert bench_validation.invariant(row, zeroshot) == "yes"
    # 51 under the untrained 52 on validation; on the tuned objective 94 against the untrained 93 (and the dense 78)
    assert bench_validation.invariant(row, zeroshot, "validation") == "no (P@1 -1.00); on P@1 + PSP@5 (the tuned objective): yes (+1.00)"
    worse = dict(row, validation_fused={"P@1": 51.0, "PSP@5": 41.5})
    assert bench_validation.invariant(worse, zeroshot, "validation").endswith("objective): no (-0.50)")
    old = {k: v for k, v in row.items() if not k.startswith("validation")}
    assert bench_validation.invariant(old, zeroshot, "validation") == "-"


def test_a_recipe_with_its_own_budget_drops_the_datasets_cpu_budget_and_batch():
    """--preset gpu's batch of 512 and its steps are not overridden by Debtags' CPU flags (--per_device_train_batch_size
    64, --num_train_epochs 0.5), which, given on the command line, would win over the preset's."""
    from benchmarks import bench_dense

    flags = ["--num_train_epochs", "0.5", "--per_device_train_batch_size", "64", "--max_seq_length", "32"]
    assert bench_dense.without_budget(flags) == ["--max_seq_length", "32"]
    assert "gpu_preset" in bench_dense.OWN_BUDGET


def test_a_decision_is_marked_among_its_own_recipes_once_each_has_validation_metrics(monkeypatch, tmp_path):
    """bench_dense marks the recipe a DECISIONS entry takes by the fused validation P@1 + PSP@5 (never the test
    columns); another recipe of the same (dataset, method) without validation metrics does not block it, while a
    member of the decision without them does."""
    from benchmarks import bench_dense

    monkeypatch.setattr(bench_dense, "result_path", lambda name: str(tmp_path / name))
    shown = {m: 50.0 for m in ("P@1", "P@5", "PSP@1", "PSP@5", "R@100")}

    def row(recipe, val_p1, test_p1, validated=True):
        r = {"row": f"debtags-dexml-{recipe}", "dataset": "debtags", "method": "dexml", "recipe": recipe, "flags": [], "wall_seconds": 60.0,
             "dense": shown, "fused": {**shown, "P@1": test_p1}}
        if validated:
            r["validation_fused"] = {"P@1": val_p1, "PSP@5": 40.0}
        return r

    rows = [row("in_batch", 80.0, 95.0), row("hard_negatives", 85.0, 90.0), row("clustered", 82.0, 91.0), row("bf16", 0, 0, validated=False)]
    fused = [line for line in bench_dense.table(rows).splitlines() if "| fused |" in line]
    marked = [line for line in fused if "chosen" in line]
    assert len(marked) == 1 and "| hard_negatives |" in marked[0] and "chosen (negatives)" in marked[0]  # not in_batch's test 95
    rows[2] = row("clustered", 0, 0, validated=False)
    assert "chosen" not in bench_dense.table(rows)
    # a recipe of no decision, or the only recipe run of its decision, is never marked however good its validation
    lone = [row("bf16", 99.0, 99.0), row("softmax_module1", 99.0, 99.0)]
    assert "chosen" not in bench_dense.table(lone)
    # a decision between two recipes, per (dataset, method): SiameseXML's Module IV beside DEXML's negatives
    siamese = [{**row("softmax_module1", 70.0, 99.0), "method": "siamesexml"}, {**row("softmax_classifiers", 75.0, 10.0), "method": "siamesexml"}]
    fused = [line for line in bench_dense.table(rows[:2] + [row("clustered", 82.0, 91.0)] + siamese).splitlines() if "| fused |" in line]
    marked = sorted(line.split("|")[3].strip().removesuffix(" (default)") for line in fused if "chosen" in line)
    assert marked == ["hard_negatives", "softmax_classifiers"]
    assert all("chosen (module_iv)" in line for line in fused if "softmax_classifiers" in line)
    # DEXML's clusters on WordNet-XMC v2: its defaults come from validation_fusion.json's row (the recipe "defaults"),
    # kept beside this benchmark's own no_clusters row of the same version, and the decision is taken between them
    defaults = {**row("defaults", 0, 0), "row": "wordnet-dexml", "dataset": "wordnet", "data_version": "v2", "fused_now": {**shown, "P@1": 99.0},
                "validation_fused": {"P@1": 60.0, "PSP@5": 40.0}}
    (tmp_path / "validation_fusion.json").write_text(json.dumps([defaults]))
    no_clusters = {**row("no_clusters", 62.0, 10.0), "dataset": "wordnet", "data_version": "v2"}
    fused = [line for line in bench_dense.table([no_clusters]).splitlines() if "| fused |" in line]
    assert len(fused) == 2 and [line for line in fused if "chosen (clusters)" in line] == [next(line for line in fused if "no_clusters" in line)]


def test_tables_name_the_wordnet_version_a_row_ran_on(tmp_path):
    from benchmarks import harness

    assert harness.dataset_cell("wordnet", None) == "wordnet v1"  # rows from before data_version ran v1
    assert harness.dataset_cell("wordnet", "v2") == "wordnet v2" and harness.dataset_cell("debtags", None) == "debtags"
    (tmp_path / "stats.json").write_text('{"version": "v2"}')
    assert harness.data_version("wordnet", str(tmp_path)) == "v2"
    (tmp_path / "stats.json").write_text("{}")
    assert harness.data_version("wordnet", str(tmp_path)) == "v1"
    assert harness.data_version("debtags", str(tmp_path)) is None


def test_the_recipes_of_a_decision_give_its_methods_different_arguments(tmp_path):
    """Each :data:`bench_dense.DECISIONS` entry compares recipes that its methods' scripts parse into different
    arguments on every dataset: a recipe that leaves the compared setting to the script's defaults runs the other
    recipe's configuration once the default moves (SiameseXML's ``softmax_module1`` did from 2026-11-30 to 12-05)."""
    import dataclasses
    import importlib

    from benchmarks import bench_dense
    from hf_xmc.training.script_utils import XMCArgumentParser, XMCDataArguments

    prefixes = {"dexml": "DEXML", "prime": "PRIME", "unidec": "UniDEC", "siamesexml": "SiameseXML"}
    base = ["--model_name_or_path", "m", "--train_file", "t", "--output_dir", str(tmp_path)]
    assert set(bench_dense.DECISION_METHODS) == set(bench_dense.DECISIONS)
    for decision, recipes in bench_dense.DECISIONS.items():
        for method in bench_dense.DECISION_METHODS[decision]:
            module = importlib.import_module(f"hf_xmc.training.recipes.{method}")
            classes = (getattr(module, f"{prefixes[method]}ModelArguments"), XMCDataArguments, getattr(module, f"{prefixes[method]}TrainingArguments"))
            for dataset in bench_dense.DATASETS:
                parsed = {}
                for recipe in recipes:
                    args = XMCArgumentParser(classes).parse_args_into_dataclasses(args=[*base, *bench_dense.row_flags(dataset, method, recipe)])
                    parsed[recipe] = tuple(dataclasses.asdict(a) for a in args)
                assert len({repr(p) for p in parsed.values()}) == len(recipes), (decision, method, dataset)
    # the check catches the case it is for: without the pinned Module IV, softmax_module1 parses as softmax_classifiers
    module = importlib.import_module("hf_xmc.training.recipes.siamesexml")
    classes = (module.SiameseXMLModelArguments, XMCDataArguments, module.SiameseXMLTrainingArguments)
    unpinned = [f for f in bench_dense.SOFTMAX_MODULE1 if f not in bench_dense.PAPER_MODULE4]
    parse = lambda flags: repr(tuple(dataclasses.asdict(a) for a in XMCArgumentParser(classes).parse_args_into_dataclasses(args=[*base, *flags])))  # noqa: E731
    assert parse(unpinned) == parse(bench_dense.RECIPES["softmax_classifiers"])


def test_static_rows_merge_in_place():
    """A static-encoder row run again (by bench_static_encoder.py or bench_validation.py --static_query_encoder) takes
    its old row's place; a new (dataset, method) is appended; the other rows are kept as they were."""
    from benchmarks.bench_static_encoder import merge_row

    rows = [{"dataset": "debtags", "method": "dexml", "run": 1}, {"dataset": "wordnet", "method": "prime", "run": 1},
            {"dataset": "reuters", "method": "dexml", "run": 1}]
    again = merge_row(rows, {"dataset": "wordnet", "method": "prime", "run": 2})
    assert [(r["dataset"], r["method"], r["run"]) for r in again] == [("debtags", "dexml", 1), ("wordnet", "prime", 2), ("reuters", "dexml", 1)]
    new = merge_row(again, {"dataset": "wordnet", "method": "unidec", "run": 1})
    assert [(r["dataset"], r["method"]) for r in new][-1] == ("wordnet", "unidec") and len(new) == 4
    assert rows[1]["run"] == 1  # the list given is not changed


def test_the_static_fit_benchmarks_bigrams_are_what_it_says():
    """bench_static_fit's variant the library lacks: a bigram row for each adjacent pair seen min_count times, bags of
    tokens then their known bigrams (its label term is the library's, pinned in test_static_encoder.py)."""
    from benchmarks.bench_static_fit import bigram_vocabulary, flat_bags

    rows = [[5, 6, 7], [5, 6], [6, 7, 5]]
    vocab = bigram_vocabulary(rows, min_count=2)
    assert vocab == {(5, 6): 0, (6, 7): 1}
    ids, offsets, lengths = flat_bags(rows, 10, vocab)
    assert ids.tolist() == [5, 6, 7, 10, 11, 5, 6, 10, 6, 7, 5, 11] and offsets.tolist() == [0, 5, 8] and lengths.tolist() == [5, 3, 4]
