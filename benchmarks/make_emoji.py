#!/usr/bin/env python3
"""Build Emoji-XMC, a real multimodal XMC dataset: rendered emoji + partial names -> CLDR keywords.

Sources (Debian packages, installed with ``apt-get install -y fonts-noto-color-emoji unicode-cldr-core``):

* ``fonts-noto-color-emoji``: ``NotoColorEmoji.ttf`` (Google's Noto Color Emoji, SIL Open Font
  Licence 1.1), a CBDT bitmap font; every emoji is rendered from it with Pillow.
* ``unicode-cldr-core``: the CLDR English annotations ``common/annotations/en.xml`` (per emoji a
  short name, "tts", and a list of keywords) and ``common/annotationsDerived/en.xml`` (the derived
  sequences, used here for the skin-tone variants). Unicode licence (Unicode-DFS-2016).

The task. A point is one emoji of ``annotations/en.xml`` that the font draws as one glyph. Its
targets are its CLDR keywords that at least ``--min_label_freq`` emoji share (the labels; a label's
text is the keyword, labels carry no image, like LF-AmazonTitles or A2Q-4M). Its input is

* images: the rendered emoji, plus, for emoji with skin-tone variants, one variant in a random
  skin tone (so items carry 1 or 2 images; the ``images`` field of the XC raw format), and
* text: a *partial* name: its CLDR short name without the words that are themselves target
  keywords (each dropped with probability ``--drop_target_words``, default 1), of which a random
  ``--keep_fraction`` (default 1: all) is kept. "grinning face with big eyes" (targets face, mouth,
  open, smile) becomes "grinning with big eyes", "euro banknote" (targets banknote, bill, currency,
  money, note) becomes "euro", and "relieved face" (targets face, relieved) the empty text: an
  image-only point.

Neither modality suffices alone: the text never spells out a target, so it only helps through what
the rest of the name implies ("grinning" -> smile), while the picture shows what the name leaves out
("face") but not the semantics a name carries ("euro" vs "dollar", "Japanese", "zodiac").
The baselines printed at the end check exactly that: a text-only and an image-only linear model both
sit well above the popularity baseline and well below 100, and their feature concatenation beats both.

Output (``--output_dir``, default ``outputs/emoji-xmc``): ``trn.json.gz``, ``tst.json.gz`` (uid =
code points in hex, title = partial name, target_ind, images), ``lbl.json.gz`` (uid = title = the
keyword), ``images/<codepoints>.png`` (RGB on white, ``--image_size`` square), ``README.md``
(provenance, licences, statistics) and ``stats.json`` (statistics and baseline numbers). The split is
an emoji-level seeded 80/20 split; re-running with the same seed and packages gives the same files.

Usage: python benchmarks/make_emoji.py [--output_dir DIR] [--seed 0] [--no_baselines]
Runtime: about a minute on 2 CPU cores (rendering a few seconds, the baselines' 1,300 small logistic
regressions the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import markdown_table, write_text  # noqa: E402
from hf_xmc.data import XMCDataset, write_xc_labels, write_xc_raw  # noqa: E402
from hf_xmc.metrics import xmc_metrics  # noqa: E402

INSTALL_HINT = "install them with: apt-get install -y fonts-noto-color-emoji unicode-cldr-core (as root)"
DEFAULT_FONT = "/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf"
DEFAULT_CLDR = "/usr/share/unicode/cldr/common"
FONT_SIZE = 109  # the one size a CBDT bitmap font (Noto Color Emoji) is drawn at
SKIN_TONES = range(0x1F3FB, 0x1F400)  # Fitzpatrick modifiers U+1F3FB..U+1F3FF
EMOJI_COMPONENTS = set(SKIN_TONES) | set(range(0x1F9B0, 0x1F9B4))  # skin tones and hair swatches
JOINERS = {0x200D, 0xFE0F, 0x20E3}  # ZWJ, emoji presentation selector, keycap: not glyphs of their own


# --------------------------------------------------------------------------------------------
# CLDR annotations
# --------------------------------------------------------------------------------------------


@dataclass
class Annotation:
    """One CLDR annotation: the short (tts) name and the keywords of an emoji sequence."""

    name: str
    keywords: list[str]


def parse_annotations(source: str) -> dict[str, Annotation]:
    """Parse a CLDR annotations XML file (path or XML text) into ``{code point sequence: Annotation}``.

    Each emoji has two ``<annotation cp="...">`` elements: one with ``type="tts"`` (the short name) and
    one with the keywords separated by ``|``. Entries missing either part are dropped.
    """
    root = ET.fromstring(source) if source.lstrip().startswith("<") else ET.parse(source).getroot()
    names: dict[str, str] = {}
    keywords: dict[str, list[str]] = {}
    for el in root.iter("annotation"):
        cp, text = el.get("cp"), (el.text or "").strip()
        if not cp or not text:
            continue
        if el.get("type") == "tts":
            names[cp] = text
        else:
            keywords[cp] = [k.strip() for k in text.split("|") if k.strip()]
    return {cp: Annotation(names[cp], keywords[cp]) for cp in keywords if cp in names}


def strip_skin_tones(seq: str) -> str:
    """The sequence without skin-tone modifiers and U+FE0F (the form ``annotations/en.xml`` keys use)."""
    return "".join(ch for ch in seq if ord(ch) not in SKIN_TONES and ord(ch) != 0xFE0F)


def skin_tone_variants(derived: dict[str, Annotation], bases: set[str]) -> dict[str, list[str]]:
    """Map each base emoji to its derived skin-tone sequences (sorted, for determinism)."""
    out: dict[str, list[str]] = {}
    for seq in sorted(derived):
        if any(ord(ch) in SKIN_TONES for ch in seq) and len(seq) > 1:
            base = strip_skin_tones(seq)
            if base in bases and base != seq:
                out.setdefault(base, []).append(seq)
    return out


def choose_labels(keywords_by_item: Sequence[Sequence[str]], min_freq: int) -> tuple[list[str], Counter]:
    """Keywords shared by at least ``min_freq`` items, most frequent first (ties alphabetically)."""
    freq = Counter(k for kws in keywords_by_item for k in set(kws))
    labels = sorted((k for k, n in freq.items() if n >= min_freq), key=lambda k: (-freq[k], k))
    return labels, freq


def partial_text(name: str, target_keywords: Sequence[str], rng: random.Random, drop_target_words: float = 1.0,
                 keep_fraction: float = 1.0) -> str:
    """The name without (most of) the words that are target keywords, then a random ``keep_fraction`` of the rest.

    A word matches a keyword case-insensitively and whole ("face" matches the keyword "face", not
    "face with tears"). Dropping the targets' own words stops a model from reading the answer off
    the text; ``keep_fraction`` (at least one word is kept when any remain) makes the text vaguer still.
    """
    targets = {k.lower() for k in target_keywords}
    words = [w.strip(":,") for w in name.split()]
    words = [w for w in words if w and not (w.lower() in targets and rng.random() < drop_target_words)]
    if not words or keep_fraction >= 1.0:
        return " ".join(words)
    k = max(1, round(len(words) * keep_fraction))
    keep = sorted(rng.sample(range(len(words)), k))
    return " ".join(words[i] for i in keep)


def seq_id(seq: str) -> str:
    """File/uid-friendly id of a code point sequence, e.g. '1f44d-1f3fd'."""
    return "-".join(f"{ord(ch):x}" for ch in seq)


# --------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------


class EmojiRenderer:
    """Render emoji sequences from a colour bitmap font as square RGB images on white."""

    def __init__(self, font_path: str, image_size: int) -> None:
        """Load the font (Pillow) and its character map (fontTools, a matplotlib dependency)."""
        from fontTools.ttLib import TTFont
        from PIL import ImageFont, features

        self.font = ImageFont.truetype(font_path, FONT_SIZE)
        self.cmap = set(TTFont(font_path, lazy=True).getBestCmap())
        self.image_size = image_size
        self.em = self.font.getbbox("\U0001F600")[2]  # advance of one emoji glyph
        if not features.check("raqm"):
            # without complex text layout ZWJ and skin-tone sequences come out as several glyphs
            print("warning: Pillow has no raqm layout; multi-code-point emoji will be skipped", file=sys.stderr)

    def covers(self, seq: str) -> bool:
        """True when every code point of ``seq`` (joiners aside) has a glyph in the font."""
        return all(ord(ch) in self.cmap or ord(ch) in JOINERS for ch in seq)

    def render(self, seq: str):
        """Return the rendered RGB image, or None when the font does not draw ``seq`` as one glyph."""
        from PIL import Image, ImageDraw

        if not self.covers(seq):
            return None
        left, top, right, bottom = self.font.getbbox(seq)
        if right - left > 1.5 * self.em:  # several glyphs: the sequence is not a ligature in this font
            return None
        canvas = Image.new("RGBA", (right - left, bottom - top), (0, 0, 0, 0))
        ImageDraw.Draw(canvas).text((-left, -top), seq, font=self.font, embedded_color=True)
        box = canvas.getbbox()
        if box is None:  # empty glyph
            return None
        # centre the drawn pixels on a white square, so every emoji fills the frame the same way
        glyph = canvas.crop(box)
        side = max(glyph.size)
        square = Image.new("RGB", (side, side), (255, 255, 255))
        square.paste(glyph, ((side - glyph.width) // 2, (side - glyph.height) // 2), mask=glyph.getchannel("A"))
        return square.resize((self.image_size, self.image_size), Image.Resampling.LANCZOS)


def save_png(image, path: str) -> None:
    """Write a PNG atomically (temp file beside it, then rename): no half-written image survives a crash."""
    from hf_xmc.models.io_utils import atomic_write

    atomic_write(path, lambda tmp: image.save(tmp, format="PNG", optimize=True))


# --------------------------------------------------------------------------------------------
# the dataset
# --------------------------------------------------------------------------------------------


@dataclass
class EmojiItem:
    """One point: the emoji, its partial name, its image files and its target keywords."""

    seq: str
    name: str
    text: str
    images: list[str]
    targets: list[int]


def check_sources(font_path: str, cldr_dir: str) -> tuple[str, str]:
    """Return the two annotation files; exit with the install command when a source is missing."""
    ann = os.path.join(cldr_dir, "annotations", "en.xml")
    derived = os.path.join(cldr_dir, "annotationsDerived", "en.xml")
    missing = [p for p in (font_path, ann, derived) if not os.path.isfile(p)]
    if missing:
        sys.exit(f"make_emoji.py: missing {', '.join(missing)}\nThe Debian packages fonts-noto-color-emoji and "
                 f"unicode-cldr-core provide them; {INSTALL_HINT} (or pass --font / --cldr_dir).")
    return ann, derived


def build_items(renderer: EmojiRenderer, annotations: dict[str, Annotation], derived: dict[str, Annotation],
                image_dir: str, min_label_freq: int, drop_target_words: float, keep_fraction: float,
                seed: int) -> tuple[list[EmojiItem], list[str], Counter, dict]:
    """Render the emoji, choose the labels and compose every point (deterministic for a seed)."""
    # separate streams: changing the text options does not change which skin-tone images are drawn
    text_rng, tone_rng = random.Random(seed), random.Random(seed + 2)
    rendered: dict[str, object] = {}
    for seq in annotations:
        if len(seq) == 1 and ord(seq) in EMOJI_COMPONENTS:
            continue  # bare skin-tone / hair swatches are parts of emoji, not emoji
        if all(ord(ch) < 0x80 for ch in seq):
            continue  # ASCII ('#', digits) has glyphs in the font only as keycap bases
        image = renderer.render(seq)
        if image is not None:
            rendered[seq] = image
    variants = skin_tone_variants(derived, set(rendered))
    labels, freq = choose_labels([annotations[s].keywords for s in rendered], min_label_freq)
    label_id = {k: i for i, k in enumerate(labels)}
    os.makedirs(image_dir, exist_ok=True)
    items: list[EmojiItem] = []
    dropped = 0
    for seq, image in rendered.items():
        ann = annotations[seq]
        targets = sorted({label_id[k] for k in ann.keywords if k in label_id})
        if not targets:
            dropped += 1
            continue
        paths = [os.path.join(image_dir, seq_id(seq) + ".png")]
        save_png(image, paths[0])
        for variant in tone_rng.sample(variants.get(seq, []), len(variants.get(seq, []))):
            tone_image = renderer.render(variant)
            if tone_image is not None:  # the first variant the font draws as one glyph
                paths.append(os.path.join(image_dir, seq_id(variant) + ".png"))
                save_png(tone_image, paths[-1])
                break
        text = partial_text(ann.name, [labels[j] for j in targets], text_rng, drop_target_words, keep_fraction)
        items.append(EmojiItem(seq=seq, name=ann.name, text=text, images=paths, targets=targets))
    info = {"rendered_emoji": len(rendered), "emoji_without_label": dropped,
            "emoji_with_skin_tone_variants": sum(1 for s in rendered if s in variants)}
    return items, labels, freq, info


def to_dataset(items: Sequence[EmojiItem], num_labels: int) -> XMCDataset:
    """Pack items into an :class:`XMCDataset` (CSR targets, image paths)."""
    indptr = np.cumsum([0] + [len(it.targets) for it in items])
    indices = np.fromiter((j for it in items for j in it.targets), dtype=np.int64, count=int(indptr[-1]))
    targets = sp.csr_matrix((np.ones(len(indices), np.float32), indices, indptr), shape=(len(items), num_labels))
    return XMCDataset(texts=[it.text for it in items], targets=targets, uids=[seq_id(it.seq) for it in items],
                      images=[list(it.images) for it in items])


def split_items(items: list[EmojiItem], test_fraction: float, seed: int) -> tuple[list[EmojiItem], list[EmojiItem]]:
    """Seeded emoji-level split; both parts keep the CLDR file order."""
    order = list(range(len(items)))
    random.Random(seed + 1).shuffle(order)  # its own stream: the split does not move when texts change
    test = set(order[:round(len(items) * test_fraction)])
    return [it for i, it in enumerate(items) if i not in test], [it for i, it in enumerate(items) if i in test]


def statistics(train: XMCDataset, test: XMCDataset, labels: list[str]) -> dict:
    """Points, labels, labels per point, images per item and label frequencies."""
    def part(ds: XMCDataset) -> dict:
        per_point = ds.targets.getnnz(axis=1)
        n_img = Counter(len(x) for x in ds.images)
        return {"points": len(ds), "avg_labels_per_point": round(float(per_point.mean()), 3),
                "max_labels_per_point": int(per_point.max()),
                "images_per_item": {str(k): n_img[k] for k in sorted(n_img)},
                "avg_words_per_text": round(float(np.mean([len(t.split()) for t in ds.texts])), 3),
                "empty_texts": sum(1 for t in ds.texts if not t)}

    train_freq = np.asarray(train.targets.sum(axis=0)).ravel()
    test_freq = np.asarray(test.targets.sum(axis=0)).ravel()
    return {"labels": len(labels), "train": part(train), "test": part(test),
            "label_freq_train": {"min": int(train_freq.min()), "median": float(np.median(train_freq)),
                                 "mean": round(float(train_freq.mean()), 3), "max": int(train_freq.max()),
                                 "labels_without_train_point": int((train_freq == 0).sum())},
            "test_labels_without_train_point": int(((train_freq == 0) & (test_freq > 0)).sum()),
            "most_frequent_labels": [[labels[j], int(train_freq[j])] for j in np.argsort(-train_freq, kind="stable")[:10]]}


# --------------------------------------------------------------------------------------------
# baselines
# --------------------------------------------------------------------------------------------


def image_features(ds: XMCDataset, side: int = 16) -> np.ndarray:
    """Downsampled RGB pixels averaged over the item's images (a crude bag of images), L2-normalised."""
    from PIL import Image

    feats = np.zeros((len(ds), side * side * 3), np.float32)
    for i, paths in enumerate(ds.images):
        for p in paths:
            with Image.open(p) as im:
                feats[i] += np.asarray(im.convert("RGB").resize((side, side), Image.Resampling.BOX), np.float32).ravel()
        feats[i] /= max(len(paths), 1)
    feats = 1.0 - feats / 255.0  # white background = 0, so empty space carries no weight
    return feats / np.maximum(np.linalg.norm(feats, axis=1, keepdims=True), 1e-9)


def one_vs_rest_scores(x_train, y_train: sp.csr_matrix, x_test, c: float) -> np.ndarray:
    """Scores of one logistic regression per label with a training positive (-inf for the others)."""
    from sklearn.linear_model import LogisticRegression

    y = y_train.toarray()
    scores = np.full((x_test.shape[0], y.shape[1]), -np.inf, np.float32)
    for j in np.flatnonzero(y.sum(axis=0) > 0):
        model = LogisticRegression(C=c, solver="liblinear").fit(x_train, y[:, j])  # ~10x faster than lbfgs here
        scores[:, j] = model.decision_function(x_test)
    return scores


def evaluate(scores: np.ndarray, truth: sp.csr_matrix) -> dict[str, float]:
    """P@1/3/5 and nDCG@1/3/5 (percentages) of the top-5 of ``scores``."""
    top = np.argsort(-scores, axis=1, kind="stable")[:, :5]
    return {k: round(v, 2) for k, v in xmc_metrics(top, truth, ks=(1, 3, 5), recall_ks=()).items()}


def run_baselines(train: XMCDataset, test: XMCDataset, labels: list[str], c: float = 10.0) -> dict[str, dict]:
    """Popularity, text-only, image-only and text+image linear baselines on the test split."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.preprocessing import normalize

    truth = test.targets
    results: dict[str, dict] = {}
    popularity = np.tile(np.asarray(train.targets.sum(axis=0), np.float32), (len(test), 1))
    results["popularity (most frequent train labels)"] = evaluate(popularity, truth)
    # character n-grams: partial names are short, and 'grinning' should meet 'grin'
    vec = TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 4), sublinear_tf=True).fit(list(train.texts) + labels)
    t_train, t_test, t_labels = vec.transform(train.texts), vec.transform(test.texts), vec.transform(labels)
    results["text: TF-IDF nearest label (cosine to the keyword)"] = evaluate((t_test @ t_labels.T).toarray(), truth)
    results["text: TF-IDF + one-vs-rest logistic regression"] = evaluate(
        one_vs_rest_scores(t_train, train.targets, t_test, c), truth)
    i_train, i_test = image_features(train), image_features(test)
    results["image: 16x16 pixels + one-vs-rest logistic regression"] = evaluate(
        one_vs_rest_scores(i_train, train.targets, i_test, c), truth)
    # equal weight to both unit-norm blocks
    both_train = normalize(sp.hstack([t_train, sp.csr_matrix(i_train)]).tocsr())
    both_test = normalize(sp.hstack([t_test, sp.csr_matrix(i_test)]).tocsr())
    results["text+image: concatenated features + one-vs-rest LR"] = evaluate(
        one_vs_rest_scores(both_train, train.targets, both_test, c), truth)
    return results


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------


def write_readme(path: str, args: argparse.Namespace, stats: dict, baselines: dict | None, info: dict) -> None:
    """Write the dataset card (provenance, licences, statistics, baselines) atomically."""
    tr, te = stats["train"], stats["test"]
    lines = [
        "# Emoji-XMC: rendered emoji + partial names -> CLDR keywords",
        "",
        f"Built by `benchmarks/make_emoji.py` of hf_xmc (seed {args.seed}, min_label_freq {args.min_label_freq}, "
        f"drop_target_words {args.drop_target_words}, keep_fraction {args.keep_fraction}, image_size {args.image_size}). Do not edit by hand: re-run the script.",
        "",
        "A point is an emoji: its images (the emoji rendered from Noto Color Emoji, plus one random skin-tone "
        "variant where CLDR lists some) and a partial text: its CLDR short name without the words that are "
        "themselves target keywords (so the text never spells out an answer; it may be empty). "
        "Its targets are its CLDR keywords shared by at least "
        f"{args.min_label_freq} emoji; a label's text is the keyword.",
        "",
        "## Files",
        "",
        "* `trn.json.gz`, `tst.json.gz`: XC raw JSON lines `uid` (code points in hex), `title` (partial name), "
        "`target_ind` (ids into lbl.json.gz), `images` (paths relative to this folder); `title` may be empty",
        "* `lbl.json.gz`: `uid` and `title` = the keyword",
        "* `images/<code points>.png`: RGB PNGs on white; `stats.json`: statistics and baselines",
        "",
        "## Statistics",
        "",
        markdown_table(["split", "points", "avg labels/point", "images per item (count: points)", "avg words/text", "empty texts"],
                       [[name, d["points"], d["avg_labels_per_point"], d["images_per_item"], d["avg_words_per_text"], d["empty_texts"]]
                        for name, d in (("train", tr), ("test", te))]),
        "",
        f"{stats['labels']} labels; training points per label: min {stats['label_freq_train']['min']}, median "
        f"{stats['label_freq_train']['median']}, max {stats['label_freq_train']['max']}. "
        f"{info['rendered_emoji']} emoji rendered, {info['emoji_without_label']} dropped for having no label.",
        "",
    ]
    if baselines:
        lines += ["## Baselines (test split)", "",
                  markdown_table(["model", "P@1", "P@3", "P@5"], [[name, f"{r['P@1']:.2f}", f"{r['P@3']:.2f}", f"{r['P@5']:.2f}"] for name, r in baselines.items()]),
                  ""]
    lines += [
        "## Provenance and licences",
        "",
        f"* Images: rendered with Pillow from `{args.font}`, Debian package `fonts-noto-color-emoji` "
        f"({package_version('fonts-noto-color-emoji')}); Noto Color Emoji, (c) Google, SIL Open Font Licence 1.1. "
        "The OFL does not restrict images made with the font (they are not Font Software; OFL FAQ 1.1).",
        f"* Names and keywords: `{args.cldr_dir}/annotations/en.xml` and `annotationsDerived/en.xml`, Debian "
        f"package `unicode-cldr-core` ({package_version('unicode-cldr-core')}); Unicode CLDR, (c) Unicode, Inc., "
        "Unicode licence (SPDX Unicode-DFS-2016), https://www.unicode.org/copyright.html",
        "",
    ]
    write_text(path, "\n".join(lines))


def package_version(package: str) -> str:
    """The installed Debian package version (dpkg status file), or 'version unknown'."""
    try:
        with open("/var/lib/dpkg/status", encoding="utf-8") as f:
            status = f.read()
    except OSError:
        return "version unknown"
    m = re.search(rf"^Package: {re.escape(package)}\n(?:[^\n]+\n)*?Version: (\S+)", status, re.MULTILINE)
    return f"version {m.group(1)}" if m else "version unknown"


def main(argv: Sequence[str] | None = None, log: Callable[[str], None] = print) -> dict:
    """Build the dataset, print its summary and baselines, return the statistics."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", default=os.path.join(REPO, "outputs", "emoji-xmc"))
    p.add_argument("--font", default=DEFAULT_FONT, help="NotoColorEmoji.ttf (fonts-noto-color-emoji)")
    p.add_argument("--cldr_dir", default=DEFAULT_CLDR, help="CLDR 'common' folder (unicode-cldr-core)")
    p.add_argument("--image_size", type=int, default=64, help="side of the square PNGs")
    p.add_argument("--min_label_freq", type=int, default=3, help="a keyword is a label when this many emoji share it")
    p.add_argument("--drop_target_words", type=float, default=1.0,
                   help="probability of dropping a name word that is one of the point's target keywords")
    p.add_argument("--keep_fraction", type=float, default=1.0, help="fraction of the other name words kept")
    p.add_argument("--test_fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no_baselines", action="store_true", help="skip the scikit-learn baselines")
    args = p.parse_args(argv)
    if (not 0.0 < args.keep_fraction <= 1.0 or not 0.0 <= args.drop_target_words <= 1.0
            or not 0.0 < args.test_fraction < 1.0 or args.image_size < 8):
        p.error("need 0 < keep_fraction <= 1, 0 <= drop_target_words <= 1, 0 < test_fraction < 1, image_size >= 8")

    t0 = time.time()
    ann_path, derived_path = check_sources(args.font, args.cldr_dir)
    annotations, derived = parse_annotations(ann_path), parse_annotations(derived_path)
    renderer = EmojiRenderer(args.font, args.image_size)
    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)
    items, labels, _, info = build_items(renderer, annotations, derived, os.path.join(out, "images"),
                                         args.min_label_freq, args.drop_target_words, args.keep_fraction, args.seed)
    train_items, test_items = split_items(items, args.test_fraction, args.seed)
    train, test = to_dataset(train_items, len(labels)), to_dataset(test_items, len(labels))
    write_xc_raw(os.path.join(out, "trn.json.gz"), train)
    write_xc_raw(os.path.join(out, "tst.json.gz"), test)
    write_xc_labels(os.path.join(out, "lbl.json.gz"), labels, labels)
    stats = statistics(train, test, labels)
    stats["build"] = info
    log(f"wrote {out} in {time.time() - t0:.1f}s")
    log(json.dumps({k: stats[k] for k in ("labels", "train", "test", "label_freq_train",
                                          "test_labels_without_train_point")}, indent=1))
    log("most frequent labels (train points): " + ", ".join(f"{k} {n}" for k, n in stats["most_frequent_labels"]))
    log("examples: " + " | ".join(f"{it.seq} '{it.text}' <- '{it.name}'" for it in test_items[:5]))
    baselines = None
    if not args.no_baselines:
        t1 = time.time()
        baselines = run_baselines(train, test, labels)
        stats["baselines"] = baselines
        log(f"\nbaselines on the test split ({len(test)} points, {time.time() - t1:.0f}s):")
        log(f"{'model':56s} {'P@1':>6s} {'P@3':>6s} {'P@5':>6s}")
        for name, r in baselines.items():
            log(f"{name:56s} {r['P@1']:6.2f} {r['P@3']:6.2f} {r['P@5']:6.2f}")
    stats["args"] = {k: v for k, v in vars(args).items() if k != "output_dir"}
    from hf_xmc.models.io_utils import atomic_write

    def _write_stats(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(stats, f, indent=1, ensure_ascii=False)
            f.write("\n")

    atomic_write(os.path.join(out, "stats.json"), _write_stats)
    write_readme(os.path.join(out, "README.md"), args, stats, baselines, info)
    return stats


if __name__ == "__main__":
    main()
