"""Tests for benchmarks/make_emoji.py: its pure functions, and a full build when the Debian sources are installed."""

from __future__ import annotations

import importlib.util
import os
import random
import sys

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "make_emoji.py")


def _load():
    """Import the script by path (registered in sys.modules: its dataclasses need that)."""
    spec = importlib.util.spec_from_file_location("make_emoji", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_emoji"] = module
    spec.loader.exec_module(module)
    return module


me = _load()
HAVE_SOURCES = os.path.isfile(me.DEFAULT_FONT) and os.path.isdir(os.path.join(me.DEFAULT_CLDR, "annotations"))

XML = """<?xml version="1.0" encoding="UTF-8" ?>
<ldml><annotations>
  <annotation cp="😀">face | grin | grinning face</annotation>
  <annotation cp="😀" type="tts">grinning face</annotation>
  <annotation cp="💶">banknote | bill | currency | euro | money | note</annotation>
  <annotation cp="💶" type="tts">euro banknote</annotation>
  <annotation cp="👍">+1 | hand | thumb | thumbs up | up</annotation>
  <annotation cp="👍" type="tts">thumbs up</annotation>
  <annotation cp="🙈">no tts name | dropped</annotation>
</annotations></ldml>"""

DERIVED = """<ldml><annotations>
  <annotation cp="👍🏽">+1 | hand | medium skin tone | thumb | thumbs up | up</annotation>
  <annotation cp="👍🏽" type="tts">thumbs up: medium skin tone</annotation>
  <annotation cp="👍🏻">+1 | hand | light skin tone | thumb | thumbs up | up</annotation>
  <annotation cp="👍🏻" type="tts">thumbs up: light skin tone</annotation>
  <annotation cp="👩🏽‍⚕️">doctor | medium skin tone | woman</annotation>
  <annotation cp="👩🏽‍⚕️" type="tts">woman health worker: medium skin tone</annotation>
  <annotation cp="🇩🇪">flag</annotation>
  <annotation cp="🇩🇪" type="tts">flag: Germany</annotation>
</annotations></ldml>"""


def test_parse_annotations_inline_and_file(tmp_path):
    ann = me.parse_annotations(XML)
    assert list(ann) == ["😀", "💶", "👍"]  # 🙈 has no tts name
    assert ann["💶"].name == "euro banknote"
    assert ann["💶"].keywords == ["banknote", "bill", "currency", "euro", "money", "note"]
    path = tmp_path / "en.xml"
    path.write_text(XML, encoding="utf-8")
    assert me.parse_annotations(str(path)) == ann


def test_skin_tone_variants_map_to_their_base():
    derived = me.parse_annotations(DERIVED)
    assert me.strip_skin_tones("👩🏽‍⚕️") == "👩‍⚕"  # the form annotations/en.xml uses (no U+FE0F)
    variants = me.skin_tone_variants(derived, {"👍", "👩‍⚕", "😀"})
    assert variants == {"👍": sorted(["👍🏽", "👍🏻"]), "👩‍⚕": ["👩🏽‍⚕️"]}
    assert me.seq_id("👍🏽") == "1f44d-1f3fd"


def test_choose_labels_frequency_cut_and_order():
    labels, freq = me.choose_labels([["face", "smile"], ["face", "cat", "face"], ["cat", "face"], ["dog"]], 2)
    assert labels == ["face", "cat"]  # most frequent first; a keyword repeated in one item counts once
    assert freq["face"] == 3 and freq["dog"] == 1
    assert me.choose_labels([["b"], ["a"]], 1)[0] == ["a", "b"]  # ties alphabetically


def test_partial_text_drops_target_words():
    rng = random.Random(0)
    assert me.partial_text("grinning face with big eyes", ["face", "smile"], rng) == "grinning with big eyes"
    assert me.partial_text("relieved face", ["Face", "relieved"], rng) == ""  # case-insensitive; may be empty
    assert me.partial_text("flag: Germany", ["flag"], rng) == "Germany"
    # multi-word keywords do not remove single words
    assert me.partial_text("thumbs up", ["thumbs up"], rng) == "thumbs up"
    assert me.partial_text("thumbs up", ["up"], rng, drop_target_words=0.0) == "thumbs up"


def test_partial_text_keep_fraction_is_seeded_and_ordered():
    name = "face with steam from nose"
    texts = {me.partial_text(name, [], random.Random(s), keep_fraction=0.4) for s in range(30)}
    for t in texts:
        words = t.split()
        assert len(words) == 2 and words == [w for w in name.split() if w in words]
    assert len(texts) > 3
    assert me.partial_text(name, [], random.Random(1), keep_fraction=0.4) == \
        me.partial_text(name, [], random.Random(1), keep_fraction=0.4)
    assert me.partial_text("troll", [], random.Random(0), keep_fraction=0.1) == "troll"  # at least one word


def test_split_and_to_dataset():
    items = [me.EmojiItem(seq=chr(0x1F600 + i), name=f"n{i}", text=f"t{i}", images=[f"/i/{i}.png"], targets=[i % 3])
             for i in range(50)]
    train, test = me.split_items(items, 0.2, seed=0)
    assert len(test) == 10 and len(train) == 40 and {it.seq for it in train}.isdisjoint(it.seq for it in test)
    assert [it.seq for it in me.split_items(items, 0.2, seed=0)[1]] == [it.seq for it in test]
    assert [it.seq for it in me.split_items(items, 0.2, seed=5)[1]] != [it.seq for it in test]
    ds = me.to_dataset(test, num_labels=3)
    assert ds.uids == [me.seq_id(it.seq) for it in test] and ds.images == [it.images for it in test]
    assert ds.label_lists() == [it.targets for it in test]


def test_missing_sources_exit_with_install_command(tmp_path):
    with pytest.raises(SystemExit) as excinfo:
        me.check_sources(str(tmp_path / "NotoColorEmoji.ttf"), str(tmp_path))
    msg = str(excinfo.value)
    assert "NotoColorEmoji.ttf" in msg and "apt-get install -y fonts-noto-color-emoji unicode-cldr-core" in msg


@pytest.mark.skipif(not HAVE_SOURCES, reason="needs: apt-get install -y fonts-noto-color-emoji unicode-cldr-core")
def test_renderer_draws_emoji_and_refuses_non_glyphs():
    renderer = me.EmojiRenderer(me.DEFAULT_FONT, 32)
    img = renderer.render("😀")
    assert img.mode == "RGB" and img.size == (32, 32)
    assert img.getpixel((0, 0)) == (255, 255, 255) and img.getpixel((16, 16)) != (255, 255, 255)
    assert renderer.render("{") is None  # not in the emoji font


@pytest.mark.skipif(not HAVE_SOURCES, reason="needs: apt-get install -y fonts-noto-color-emoji unicode-cldr-core")
def test_full_build_reads_back(tmp_path):
    from hf_xmc.data import load_xc_dataset

    out = tmp_path / "emoji"
    stats = me.main(["--output_dir", str(out), "--no_baselines", "--image_size", "16"], log=lambda s: None)
    data = load_xc_dataset(out / "trn.json.gz", out / "tst.json.gz", out / "lbl.json.gz")  # checks every image exists
    assert len(data.train) == stats["train"]["points"] > 800 and len(data.test) == stats["test"]["points"] > 200
    assert 200 <= data.num_labels <= 1000
    assert {len(x) for x in data.train.images} == {1, 2}
    labels = list(data.label_texts)
    for text, row in zip(data.train.texts, data.train.label_lists()):
        assert not set(text.lower().split()) & {labels[j].lower() for j in row}  # no target spelt out
    assert (out / "README.md").read_text(encoding="utf-8").count("Unicode-DFS-2016") == 1
