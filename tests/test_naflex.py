"""NaFlex inputs (mmpretrain/data/naflex.py): the grid rule, patchify, the padding and mask, against a naive
per-image reference and transformers' Siglip2 image processor; the token budget's steps."""

import numpy as np
import pytest
import torch
from PIL import Image

from mmpretrain.data import naflex


def _photo(h: int, w: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (max(1, h // 8), max(1, w // 8), 3), dtype=np.uint8)
    return Image.fromarray(base).resize((w, h), Image.BICUBIC)


def _naive(img: Image.Image, seq_len: int, p: int):
    """One image by hand: the grid by trying every scale step, pixels cut patch by patch."""
    gh, gw = naflex.grid_for(img.height, img.width, p, seq_len)
    arr = np.asarray(img.resize((gw * p, gh * p), Image.BILINEAR))
    rows, coords = [], []
    for r in range(gh):
        for c in range(gw):
            rows.append(arr[r * p:(r + 1) * p, c * p:(c + 1) * p, :].reshape(-1))
            coords.append((r, c))
    patches = np.zeros((seq_len, p * p * 3), np.uint8)
    patches[:len(rows)] = np.stack(rows)
    coord = np.zeros((seq_len, 2), np.int64)
    coord[:len(coords)] = coords
    valid = np.arange(seq_len) < len(rows)
    return patches, coord, valid


@pytest.mark.parametrize("size", [(32, 32), (17, 61), (61, 17), (200, 100), (5, 3), (1, 300), (96, 24)])
@pytest.mark.parametrize("seq_len", [1, 4, 16, 37, 64])
def test_the_grid_is_transformers_siglip2_rule_and_fits(size, seq_len):
    from transformers.models.siglip2.image_processing_siglip2 import get_image_size_for_max_num_patches
    h, w = size
    gh, gw = naflex.grid_for(h, w, 8, seq_len)
    assert (gh * 8, gw * 8) == get_image_size_for_max_num_patches(h, w, 8, seq_len)
    assert 1 <= gh * gw <= seq_len
    bigger = naflex.grid_for(h, w, 8, 4 * seq_len)  # a larger budget never shrinks a side
    assert bigger[0] >= gh and bigger[1] >= gw


def test_patches_coordinates_and_mask_equal_a_naive_per_image_reference():
    imgs = [_photo(40, 40, 0), _photo(20, 70, 1), _photo(90, 30, 2), _photo(7, 9, 3)]
    seq_len, p = 24, 8
    per = [naflex.image_patches(im, seq_len, p) for im in imgs]
    patches, coord, valid = naflex.pack([x for x, _ in per], [g for _, g in per], seq_len)
    assert patches.shape == (4, seq_len, p * p * 3) and patches.dtype == torch.uint8
    for i, im in enumerate(imgs):
        ref_p, ref_c, ref_v = _naive(im, seq_len, p)
        assert np.array_equal(patches[i].numpy(), ref_p)
        assert np.array_equal(coord[i].numpy(), ref_c)
        assert np.array_equal(valid[i].numpy(), ref_v)
    # aspect kept: the wide image has more columns than rows, the tall one more rows
    assert per[1][1][1] > per[1][1][0] and per[2][1][0] > per[2][1][1]


def test_normalised_patches_equal_the_siglip2_processor():
    pytest.importorskip("transformers.models.siglip2.image_processing_pil_siglip2")
    from transformers.models.siglip2.image_processing_pil_siglip2 import Siglip2ImageProcessorPil
    proc = Siglip2ImageProcessorPil(patch_size=8, max_num_patches=24)
    imgs = [_photo(40, 40, 0), _photo(20, 70, 1), _photo(90, 30, 2)]
    out = proc(imgs, return_tensors="pt")
    per = [naflex.image_patches(im, 24, 8) for im in imgs]
    patches, _, valid = naflex.pack([x for x, _ in per], [g for _, g in per], 24)
    ours = naflex.normalize_patches(patches, torch.tensor([0.5] * 3), torch.tensor([0.5] * 3))
    assert [tuple(s) for s in out["spatial_shapes"].tolist()] == [g for _, g in per]
    assert torch.equal(out["pixel_attention_mask"].bool(), valid)
    torch.testing.assert_close(ours * valid[..., None], out["pixel_values"].float() * valid[..., None],
                               atol=1e-6, rtol=0)


def test_pack_refuses_a_grid_longer_than_the_sequence():
    p, g = naflex.image_patches(_photo(64, 64), 16, 8)
    with pytest.raises(ValueError, match="does not fit 8"):
        naflex.pack([p], [g], 8)


def test_token_budget_steps_and_lengths():
    seq_lens, budget = [16, 36, 64], 256
    assert naflex.batch_sizes(seq_lens, budget) == [16, 7, 4]
    for sizes_tokens in zip(naflex.batch_sizes(seq_lens, budget), seq_lens):
        assert sizes_tokens[0] * sizes_tokens[1] <= budget
    # 2 ranks: one cycle takes 2 x 27 = 54 samples; then 2 x 16 = 32 fit, then 2 x 7 = 14 if 14 are left
    assert naflex.steps_per_epoch(seq_lens, budget, 100, 2) == 5
    assert naflex.steps_per_epoch(seq_lens, budget, 99, 2) == 4
    assert naflex.steps_per_epoch(seq_lens, budget, 53, 2) == 2
    a = naflex.step_lengths(seq_lens, 0, 0, 10)
    assert a == naflex.step_lengths(seq_lens, 0, 0, 10)  # seeded
    for c in range(3):
        assert sorted(a[3 * c:3 * c + 3]) == [0, 1, 2]  # each length once per cycle
    assert a[9:] == [0]
    assert any(naflex.step_lengths(seq_lens, 0, e, 9) != a[:9] for e in (1, 2, 3))  # the epoch reseeds
