"""benchmarks/harness.py: the docs-block update and the table renderer every benchmark script uses, and the docs'
benchmark tables being exactly what their scripts render from the committed results (none typed by hand)."""

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
        bench_debtags,
        bench_dense,
        bench_dexml_modes,
        bench_index,
        bench_mufin,
        bench_new_labels,
        bench_peft,
        bench_scale,
        bench_serving,
        bench_siamesexml_module1,
        bench_space_load,
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
        "new-labels": ("new_labels.json", lambda r: bench_new_labels.new_labels_table(r["rows"])),
        "prime": ("prime.json", modes),
        "prime-ablation-reuters": ("prime_ablation_reuters.json", modes),
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
        "calibration_depth": ("calibration_depth.json", bench_calibration_depth.table),
        "wordnet_quality": ("wordnet_quality.json", bench_wordnet.table),
        "peers_wordnet": ("peers_wordnet.json", lambda r: peers.peers_table(r["rows"])),
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
