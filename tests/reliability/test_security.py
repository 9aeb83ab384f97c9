"""Untrusted files never run code: no unpickling anywhere in the package (weights from safetensors or
``torch.load(weights_only=True)``), and tar member names cannot become paths outside a dataset."""

from __future__ import annotations

import ast
import io
import tarfile

from conftest import ROOT, run_main

SOURCES = sorted([*(ROOT / "mmpretrain").rglob("*.py"), *(ROOT / "data_tools").rglob("*.py")])


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            base = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            yield node, base, name


def test_no_unpickling_in_the_package():
    problems = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
                if names == ["UnpicklingError", "pickle"]:
                    continue  # the exception torch.load(weights_only=True) raises, to name the refusal
                if any(n in ("pickle", "dill", "cloudpickle", "joblib") for n in names):
                    problems.append(f"{path.name}:{node.lineno} imports a pickler")
        for node, base, name in _calls(tree):
            if base == "torch" and name == "load":
                kw = {k.arg: k.value for k in node.keywords}
                if not (isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True):
                    problems.append(f"{path.name}:{node.lineno} torch.load without weights_only=True")
            if name == "register_for_checkpointing":
                problems.append(f"{path.name}:{node.lineno} accelerate custom-object checkpointing unpickles")
            if base in ("np", "numpy") and name == "load":
                kw = {k.arg: k.value for k in node.keywords}
                if isinstance(kw.get("allow_pickle"), ast.Constant) and kw["allow_pickle"].value:
                    problems.append(f"{path.name}:{node.lineno} np.load(allow_pickle=True)")
    assert SOURCES and not problems, problems


def test_embedding_files_with_pickles_are_refused(tmp_path):
    """A stored embedding that is a pickled object array is a bad sample, not code to run."""
    import numpy as np

    from mmpretrain.data.decode import SampleDecoder, SkipSample

    buf = io.BytesIO()
    np.save(buf, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    png = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (8, 8)).save(png, format="PNG")
    dec = SampleDecoder(lambda im: im, embeddings="require")
    try:
        dec({"__key__": "k", "png": png.getvalue(), "txt": b"a cat", "emb.npy": buf.getvalue()}, 0, 0)
    except SkipSample as e:
        assert e.reason == "bad_embedding"
    else:
        raise AssertionError("a pickled embedding was accepted")


def test_tar_member_paths_never_become_paths(tmp_path):
    """img2dataset-style input whose members are named ../x or /abs/x: keys are sanitised, so the
    shards written hold plain names (no '/', no '..'), whatever tool extracts them later."""
    from PIL import Image

    src = tmp_path / "in"
    src.mkdir()
    png = io.BytesIO()
    Image.new("RGB", (40, 40), "red").save(png, format="PNG")
    with tarfile.open(src / "00000.tar", "w") as t:
        for name, data in (("../../evil.png", png.getvalue()), ("../../evil.txt", b"a red square"),
                           ("/abs/path.png", png.getvalue()), ("/abs/path.txt", b"another red square")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    r = run_main("data_tools", "build", str(src), "--out", str(tmp_path / "out"), "--source-type", "img2dataset",
                "--image-size", "32")
    assert r.returncode == 0, r.stderr[-2000:]
    names = [m.name for shard in (tmp_path / "out").glob("*.tar") for m in tarfile.open(shard).getmembers()]
    assert names and all("/" not in n and ".." not in n.split(".")[0] for n in names), names
