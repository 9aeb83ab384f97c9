"""Build sources a careless or hostile user hands over: keys repeated across tars, paths out of
--base-dir, files that are not regular, captions past csv's field limit, NUL bytes."""

from __future__ import annotations

import io
import json

from PIL import Image

from data_tools.build import build
from mmpretrain.data.tar import read_tar

KW = dict(image_size=32, shard_size=100, workers=1)


def test_the_same_key_in_two_img2dataset_tars_is_written_once_and_counted(tmp_path, emoji_images):
    """A key repeated across tars trained twice, uncounted: build now finds it from the tars' headers
    (before writing) and keeps the first; verify reports repeats across the shards of a folder."""
    import shutil

    import webdataset as wds

    from data_tools.inspect import verify
    from mmpretrain.data.tar import tar_keys

    src = tmp_path / "i2d"
    src.mkdir()
    for t in range(3):
        with wds.TarWriter(str(src / f"{t:05d}.tar"), encoder=False) as w:
            for i, (path, caption) in enumerate(emoji_images[t * 5:(t + 1) * 5]):
                buf = io.BytesIO()
                Image.open(path).convert("RGB").save(buf, format="JPEG")
                key = "00000001" if (t, i) in ((0, 1), (2, 4)) else f"{t:04d}{i:04d}"  # tar 2 repeats tar 0's
                w.write({"__key__": key, "jpg": buf.getvalue(), "txt": caption.encode()})
    assert list(tar_keys(src / "00002.tar"))[-1] == "00000001"
    res = build(str(src), tmp_path / "out", **KW)
    assert res["samples"] == 14 and res["skipped"] == {"duplicate_key": 1}
    keys = [s["__key__"] for p in sorted((tmp_path / "out").glob("*.tar")) for s in read_tar(p)]
    assert len(keys) == len(set(keys)) == 14
    assert verify(tmp_path / "out") == {str(tmp_path / "out"): {}}
    # a shard folder whose shards repeat a key (written by another tool): verify names both places
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "out", bad)
    first = sorted(bad.glob("*.tar"))[0]
    shutil.copy(first, bad / "copy-000000.tar")
    sizes = json.loads((bad / "sizes.json").read_text())
    (bad / "sizes.json").write_text(json.dumps({**sizes, "copy-000000.tar": sizes[first.name]}))
    problems = verify(bad)[str(bad)]
    assert len(problems["duplicate_key"]) == sizes[first.name]
    assert "also in" in problems["duplicate_key"][0]


def test_table_and_folder_paths_stay_inside_the_base_dir_and_only_regular_files_are_read(tmp_path, emoji_images):
    """Relative paths may not leave --base-dir (nor symlinks out of it); absolute ones are taken as
    given; a named pipe (it hung the build) and /dev/zero (MemoryError) are skipped and counted; a
    caption past csv's 131,072-character field limit (it rejected the whole CSV) is counted; NUL
    bytes are stripped from captions."""
    import csv
    import os

    base = tmp_path / "base"
    base.mkdir()
    outside = tmp_path / "outside.png"
    outside.write_bytes(emoji_images[0][0].read_bytes())
    for i, (path, _) in enumerate(emoji_images[:4]):
        (base / f"{i}{path.suffix}").write_bytes(path.read_bytes())
    (base / "link.png").symlink_to(outside)
    os.mkfifo(base / "pipe.png")
    rows = [["0" + emoji_images[0][0].suffix, "a plain caption"],            # kept
            ["1" + emoji_images[1][0].suffix, "nul\x00 bytes\x00"],          # kept, NULs stripped
            ["2" + emoji_images[2][0].suffix, "x" * 200_000],                # caption_too_long
            [str(outside), "an absolute path, as CC3M-style tables use"],   # kept
            ["../outside.png", "escapes the base"],                          # outside_base_dir
            ["link.png", "a symlink out of the base"],                       # outside_base_dir
            ["pipe.png", "a named pipe"],                                    # not_a_regular_file
            ["/dev/zero", "a device"]]                                       # not_a_regular_file
    table = tmp_path / "t.csv"
    with open(table, "w", newline="") as f:
        csv.writer(f).writerows([["image", "caption"], *rows])
    res = build(str(table), tmp_path / "out", base_dir=str(base), **KW)
    assert res["samples"] == 3
    assert res["skipped"] == {"caption_too_long": 1, "outside_base_dir": 2, "not_a_regular_file": 2}
    captions = {s["txt"].decode() for p in (tmp_path / "out").glob("*.tar") for s in read_tar(p)}
    assert "nul bytes" in captions and not any("\x00" in c for c in captions)
    # an image folder: the symlink out of it is counted, the pipe is not an image file at all
    res = build(str(base), tmp_path / "out2", **KW)
    assert res["skipped"] == {"outside_base_dir": 1, "missing_caption": 4}
