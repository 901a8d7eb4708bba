"""Tests for the image-aware data contract: XC raw ``images`` field, HF bridge ``images`` column, load_images."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import scipy.sparse as sp
from PIL import Image

from hf_xmc.data import (
    XMCDataError,
    XMCDataset,
    from_hf_dataset,
    labels_to_hf_dataset,
    load_images,
    load_xc_dataset,
    read_xc_labels,
    read_xc_raw,
    to_hf_dataset,
    write_xc_labels,
    write_xc_raw,
)
from hf_xmc.data.xc_raw import _open_text


def _png(path, color=(255, 0, 0), mode="RGB") -> str:
    """Write a tiny PNG and return its path as a string."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new(mode, (4, 3), color).save(path)
    return str(path)


def _targets(rows: list[list[int]], num_labels: int) -> sp.csr_matrix:
    """Binary CSR from label lists."""
    indptr = np.cumsum([0] + [len(r) for r in rows])
    indices = np.array([j for r in rows for j in r], dtype=np.int64)
    return sp.csr_matrix((np.ones(len(indices), np.float32), indices, indptr), shape=(len(rows), num_labels))


def _records(path) -> list[dict]:
    """The JSON objects of a (possibly gzip) JSON-lines file."""
    with _open_text(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _image_dataset(tmp_path) -> XMCDataset:
    """Three points: two images inside the data dir, none, one image outside the data dir."""
    inside_a = _png(tmp_path / "data" / "images" / "a.png")
    inside_b = _png(tmp_path / "data" / "images" / "b.png", (0, 255, 0))
    outside = _png(tmp_path / "elsewhere" / "c.png", (0, 0, 255))
    return XMCDataset(texts=["red and green", "text only", "blue"], targets=_targets([[0, 1], [2], [1]], 3),
                      uids=["p0", "p1", "p2"], images=[[inside_a, inside_b], [], [outside]])


def _write_lines(path, lines: list[str]) -> None:
    """Write raw JSON lines."""
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


# ------------------------------------------------------------------------------------------
# XC raw reader / writer
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["trn.json.gz", "trn.json"])
def test_points_round_trip_relative_and_absolute(tmp_path, name):
    ds = _image_dataset(tmp_path)
    path = tmp_path / "data" / name
    write_xc_raw(path, ds)
    stored = [r["images"] for r in _records(path)]
    # inside the JSON's directory: relative (movable folder); outside: absolute
    assert stored == [["images/a.png", "images/b.png"], [], [ds.images[2][0]]]
    assert os.path.isabs(stored[2][0])
    back = read_xc_raw(path)
    assert back.images == ds.images and back.texts == ds.texts and back.uids == ds.uids
    assert (back.targets != ds.targets).nnz == 0
    # the whole folder moves: relative entries follow it, the absolute one stays valid
    os.rename(tmp_path / "data", tmp_path / "moved")
    moved = read_xc_raw(tmp_path / "moved" / name)
    assert moved.images[0] == [str(tmp_path / "moved" / "images" / "a.png"), str(tmp_path / "moved" / "images" / "b.png")]
    assert moved.images[2] == ds.images[2]


def test_absolute_paths_option_and_cwd_relative_input(tmp_path, monkeypatch):
    ds = _image_dataset(tmp_path)
    path = tmp_path / "data" / "tst.json"
    write_xc_raw(path, ds, relative_images=False)
    assert [r["images"] for r in _records(path)] == ds.images
    # in-memory relative paths mean what open() makes of them: relative to the working directory
    monkeypatch.chdir(tmp_path / "data")
    rel = XMCDataset(texts=["x"], targets=_targets([[0]], 1), uids=["x"], images=[["images/a.png"]])
    write_xc_raw(tmp_path / "other.json", rel)
    assert _records(tmp_path / "other.json")[0]["images"] == ["data/images/a.png"]
    assert read_xc_raw(tmp_path / "other.json").images == [[ds.images[0][0]]]


def test_select_keeps_images(tmp_path):
    ds = _image_dataset(tmp_path)
    sub = ds.select([2, 0])
    assert sub.images == [ds.images[2], ds.images[0]]
    assert ds.select(np.array([False, True, False])).images == [[]]


def test_no_images_file_is_unchanged(tmp_path):
    ds = XMCDataset(texts=["a", "b"], targets=_targets([[0], [1]], 2), uids=["a", "b"])
    path = tmp_path / "trn.json"
    write_xc_raw(path, ds)
    assert path.read_text(encoding="utf-8") == (
        '{"uid": "a", "title": "a", "target_ind": [0]}\n{"uid": "b", "title": "b", "target_ind": [1]}\n')
    assert read_xc_raw(path).images is None
    write_xc_labels(tmp_path / "lbl.json", ["l0", "l1"], ["zero", "one"])
    assert "images" not in (tmp_path / "lbl.json").read_text(encoding="utf-8")
    assert read_xc_labels(tmp_path / "lbl.json") == (["l0", "l1"], ["zero", "one"])
    assert read_xc_labels(tmp_path / "lbl.json", return_images=True) == (["l0", "l1"], ["zero", "one"], None)
    data = load_xc_dataset(path, path, tmp_path / "lbl.json")
    assert data.train.images is None and data.test.images is None and data.label_images is None


def test_some_lines_without_images_read_as_empty(tmp_path):
    _png(tmp_path / "a.png")
    path = tmp_path / "trn.json"
    _write_lines(path, ['{"uid": "0", "title": "t", "target_ind": [0]}',
                        '{"uid": "1", "title": "u", "target_ind": [0], "images": ["a.png"]}',
                        '{"uid": "2", "title": "v", "target_ind": [0], "images": []}'])
    assert read_xc_raw(path).images == [[], [str(tmp_path / "a.png")], []]


def test_skipped_unlabeled_points_drop_their_images(tmp_path):
    _png(tmp_path / "a.png")
    _png(tmp_path / "b.png")
    path = tmp_path / "trn.json"
    _write_lines(path, ['{"uid": "0", "title": "t", "target_ind": [], "images": ["a.png"]}',
                        '{"uid": "1", "title": "u", "target_ind": [0], "images": ["b.png"]}'])
    ds = read_xc_raw(path)
    assert ds.uids == ["1"] and ds.images == [[str(tmp_path / "b.png")]]


def test_labels_round_trip_and_load_xc_dataset(tmp_path):
    ds = _image_dataset(tmp_path)
    data_dir = tmp_path / "data"
    write_xc_raw(data_dir / "trn.json.gz", ds)
    write_xc_raw(data_dir / "tst.json.gz", ds.select([1, 2]))
    label_images = [[ds.images[0][1]], [], [ds.images[2][0]]]
    write_xc_labels(data_dir / "lbl.json.gz", ["l0", "l1", "l2"], ["zero", "one", "two"], images=label_images)
    assert [r["images"] for r in _records(data_dir / "lbl.json.gz")] == [["images/b.png"], [], [label_images[2][0]]]
    uids, texts, images = read_xc_labels(data_dir / "lbl.json.gz", return_images=True)
    assert (uids, texts, images) == (["l0", "l1", "l2"], ["zero", "one", "two"], label_images)
    assert read_xc_labels(data_dir / "lbl.json.gz") == (["l0", "l1", "l2"], ["zero", "one", "two"])
    data = load_xc_dataset(data_dir / "trn.json.gz", data_dir / "tst.json.gz", data_dir / "lbl.json.gz")
    assert data.train.images == ds.images and data.test.images == [[], ds.images[2]]
    assert data.label_images == label_images


@pytest.mark.parametrize("images, fault", [
    ('"a.png"', "field 'images' must be a list of image paths, got str"),
    ('{"p": "a.png"}', "field 'images' must be a list of image paths, got dict"),
    ('["a.png", 3]', "field 'images' entry 1 must be a non-empty path string, got int"),
    ('[null]', "field 'images' entry 0 must be a non-empty path string, got NoneType"),
    ('[""]', "field 'images' entry 0 must be a non-empty path string, got an empty string"),
    ('["missing.png"]', "image file not found: 'missing.png'"),
])
def test_bad_images_name_file_and_line(tmp_path, images, fault):
    _png(tmp_path / "a.png")
    good = '{"uid": "0", "title": "t", "target_ind": [0], "images": ["a.png"]}'
    bad = '{"uid": "1", "title": "u", "target_ind": [0], "images": ' + images + "}"
    for path, reader in ((tmp_path / "trn.json", read_xc_raw), (tmp_path / "lbl.json", read_xc_labels)):
        _write_lines(path, [good, "", bad])
        with pytest.raises(XMCDataError) as excinfo:
            reader(path)
        msg = str(excinfo.value)
        assert msg.startswith(f"{path}, line 3: "), msg
        assert fault in msg, msg
        assert excinfo.value.line == 3


def test_missing_image_names_resolved_path_and_check_can_be_disabled(tmp_path):
    path = tmp_path / "sub" / "trn.json"
    path.parent.mkdir()
    _write_lines(path, ['{"uid": "0", "title": "t", "target_ind": [0], "images": ["../gone.png"]}'])
    with pytest.raises(XMCDataError, match=r"line 1: image file not found: '\.\./gone\.png' \(resolved to "
                       + str(tmp_path / "gone.png").replace(".", r"\.") + r"\)"):
        read_xc_raw(path)
    assert read_xc_raw(path, check_images=False).images == [[str(tmp_path / "gone.png")]]
    with pytest.raises(XMCDataError, match="image file not found"):
        load_xc_dataset(path, path, path)
    assert load_xc_dataset(path, path, path, check_images=False).label_images == [[str(tmp_path / "gone.png")]]


def test_dataset_and_writer_validation(tmp_path):
    t = _targets([[0], [0]], 1)
    with pytest.raises(ValueError, match="1 image lists, 2 target rows"):
        XMCDataset(texts=["a", "b"], targets=t, uids=["a", "b"], images=[[]])
    with pytest.raises(TypeError, match=r"images\[1\] must be a list of image paths, got str"):
        XMCDataset(texts=["a", "b"], targets=t, uids=["a", "b"], images=[[], "x.png"])
    pil = XMCDataset(texts=["a"], targets=t[:1], uids=["a"], images=[[Image.new("RGB", (2, 2))]])
    with pytest.raises(TypeError, match="save PIL images to files first"):
        write_xc_raw(tmp_path / "trn.json", pil)
    assert not os.listdir(tmp_path)  # nothing half-written
    with pytest.raises(ValueError, match="2 uids but 1 image lists"):
        write_xc_labels(tmp_path / "lbl.json", ["a", "b"], ["A", "B"], images=[[]])


# ------------------------------------------------------------------------------------------
# HF datasets bridge
# ------------------------------------------------------------------------------------------


def test_hf_bridge_images_round_trip(tmp_path):
    import pyarrow as pa

    ds = _image_dataset(tmp_path)
    hf = to_hf_dataset(ds)
    assert hf.column_names == ["uid", "text", "labels", "images"]
    assert hf.features.arrow_schema.field("images").type == pa.list_(pa.string())
    assert hf[1]["images"] == [] and hf[0]["images"] == ds.images[0]
    back = from_hf_dataset(hf, num_labels=3)
    assert back.images == ds.images and back.texts == ds.texts and back.label_lists() == ds.label_lists()
    assert from_hf_dataset(hf.select([2, 1]), num_labels=3).images == [ds.images[2], []]
    assert from_hf_dataset(hf.select([]), num_labels=3).images == []
    # text-only datasets keep the old three columns and come back text-only
    plain = XMCDataset(texts=ds.texts, targets=ds.targets, uids=ds.uids)
    assert to_hf_dataset(plain).column_names == ["uid", "text", "labels"]
    assert from_hf_dataset(to_hf_dataset(plain), num_labels=3).images is None


def test_hf_bridge_image_feature_column_and_errors(tmp_path):
    import datasets

    a = _png(tmp_path / "a.png")
    feats = datasets.Features({"text": datasets.Value("string"), "labels": datasets.Sequence(datasets.Value("int32")),
                               "pics": datasets.Sequence(datasets.Image())})
    hf = datasets.Dataset.from_dict({"text": ["x", "y"], "labels": [[0], [1]], "pics": [[a], []]}, features=feats)
    assert from_hf_dataset(hf, num_labels=2, image_column="pics").images == [[a], []]
    bad = datasets.Dataset.from_dict({"text": ["x"], "labels": [[0]], "images": [[1, 2]]})
    with pytest.raises(ValueError, match="column 'images' must hold lists of image paths"):
        from_hf_dataset(bad, num_labels=1)
    nopath = datasets.Dataset.from_dict({"text": ["x"], "labels": [[0]], "images": [[None]]},
                                        features=datasets.Features({"text": datasets.Value("string"),
                                                                    "labels": datasets.Sequence(datasets.Value("int32")),
                                                                    "images": datasets.Sequence(datasets.Value("string"))}))
    with pytest.raises(ValueError, match="row 0: column 'images' holds an image without a path"):
        from_hf_dataset(nopath, num_labels=1)


def test_labels_to_hf_dataset_images(tmp_path):
    hf = labels_to_hf_dataset(["x", "y"], ["X", "Y"], images=[["/a.png"], []])
    assert hf.column_names == ["label_id", "uid", "text", "images"]
    assert hf[:]["images"] == [["/a.png"], []]
    assert labels_to_hf_dataset(["x"], ["X"]).column_names == ["label_id", "uid", "text"]
    with pytest.raises(ValueError, match="2 uids but 1 image lists"):
        labels_to_hf_dataset(["x", "y"], ["X", "Y"], images=[[]])


# ------------------------------------------------------------------------------------------
# load_images
# ------------------------------------------------------------------------------------------


def test_load_images_paths_and_pil(tmp_path):
    rgb = _png(tmp_path / "rgb.png", (10, 20, 30))
    gray = _png(tmp_path / "gray.png", 128, mode="L")
    transparent = _png(tmp_path / "t.png", (0, 0, 0, 0), mode="RGBA")
    in_memory = Image.new("RGBA", (2, 2), (255, 0, 0, 255))
    out = load_images([rgb, gray, transparent, in_memory, tmp_path / "rgb.png"])
    assert [im.mode for im in out] == ["RGB"] * 5
    assert out[0].getpixel((0, 0)) == (10, 20, 30) and out[0].size == (4, 3)
    assert out[1].getpixel((0, 0)) == (128, 128, 128)
    assert out[2].getpixel((0, 0)) == (255, 255, 255)  # transparency on white, not black
    assert out[3].getpixel((0, 0)) == (255, 0, 0)
    assert load_images([]) == []



def test_load_images_converts_as_the_model_does():
    """hf_xmc.data keeps a twin of MUFIN's RGB conversion (the data layer may not import the models): the two give the
    same pixels for every mode with or without transparency, semi-transparent pixels included."""
    from hf_xmc.models.processing_mufin import to_rgb

    rgba = Image.fromarray(np.random.default_rng(0).integers(0, 256, (5, 6, 4), dtype=np.uint8))
    palette = rgba.convert("RGB").quantize(8)
    palette.info["transparency"] = 0
    for image in (rgba, rgba.convert("LA"), palette, rgba.convert("RGB").quantize(8), rgba.convert("L"), rgba.convert("CMYK")):
        expected = to_rgb(image)
        assert np.array_equal(np.asarray(load_images([image])[0]), np.asarray(expected)), image.mode
        assert expected.mode == "RGB"

def test_load_images_errors_name_the_path(tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png at all")
    with pytest.raises(XMCDataError, match=f"^{broken}: cannot read image"):
        load_images([broken])
    full = tmp_path / "full.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(full)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(full.read_bytes()[: full.stat().st_size // 2])  # header fine, pixel data cut
    with pytest.raises(XMCDataError, match=f"^{truncated}: cannot read image"):
        load_images([truncated])
    with pytest.raises(XMCDataError, match=f"^{tmp_path / 'nope.png'}: image file not found"):
        load_images([tmp_path / "nope.png"])
    with pytest.raises(TypeError, match="wrap a single path in a list"):
        load_images(str(full))
    assert load_images([full])[0].size == (64, 64)
    with pytest.raises(TypeError, match="path or a PIL image, got int"):
        load_images([3])
