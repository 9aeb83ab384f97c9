"""The fast training crop (mmpretrain.data.crop): its boxes are torchvision's ``RandomResizedCrop`` in
distribution, its pixels are torchvision's ``resized_crop`` of the same box (bit for bit at full size,
within a stated tolerance when the JPEG is decoded reduced), and only open_clip's plain augmentation
takes it."""

from __future__ import annotations

import functools
import io
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image
from scipy.stats import chi2_contingency
from torchvision.transforms import InterpolationMode, RandomResizedCrop

from mmpretrain.data.crop import Box, CropSampler, ResizedCrop, fast_train_transform
from mmpretrain.data.decode import DeviceNormalize, SampleDecoder, SkipSample, split_normalize
from mmpretrain.testing.photos import make_jpegs

ROOT = Path(__file__).resolve().parents[1]

# (width, height): 1:1, 4:3, 3:2, 2:1 and portrait 2:3
ASPECTS = {"1:1": (400, 400), "4:3": (400, 300), "3:2": (450, 300), "2:1": (512, 256), "2:3": (300, 450)}
OPEN_CLIP = ((0.9, 1.0), (3 / 4, 4 / 3))  # open_clip's default aug_cfg.scale, torchvision's ratio
TORCHVISION = ((0.08, 1.0), (3 / 4, 4 / 3))  # torchvision's defaults (aug_cfg.scale=[0.08, 1])
TIMM = ((0.35, 1.0), (1 / 2, 2.0))  # a wider ratio, as aug_cfg.use_timm passes it on
OURS_DRAWS = 50_000  # make test; the slow test below draws 100k of each
REF_DRAWS = 10_000  # torchvision's get_params: ~10x our sampler's time per draw (ten tries at open_clip's scale)
# a false alarm in 1,000 runs over all of them: Bonferroni over 3 configs x 5 aspects x 4 statistics
ALPHA = 1e-3 / (3 * len(ASPECTS) * 4)


@functools.cache  # the mutant tests reuse the distribution tests' draws
def reference(width: int, height: int, scale, ratio, n: int) -> list[Box]:
    torch.manual_seed(0)
    img = Image.new("L", (width, height))
    return [Box(*RandomResizedCrop.get_params(img, list(scale), list(ratio))) for _ in range(n)]


def fallback(width: int, height: int, ratio) -> Box:
    """torchvision's centre crop after ten failed tries, transcribed."""
    r = width / height
    w, h = (width, round(width / ratio[0])) if r < ratio[0] else (
        (round(height * ratio[1]), height) if r > ratio[1] else (width, height))
    return Box((height - h) // 2, (width - w) // 2, h, w)


def p_values(a: list[Box], b: list[Box], width: int, height: int, ratio) -> dict[str, float]:
    """Two-sample chi-square p-values: the fallback rate; the joint (area fraction, log aspect) of the
    other boxes in quantile cells of the pooled draws; their relative vertical and horizontal position."""
    fb = fallback(width, height, ratio)

    def split(boxes):
        arr = np.array(boxes, dtype=np.float64)
        is_fb = (arr == np.array(fb)).all(1)
        return arr[~is_fb], int(is_fb.sum())

    (ra, fa), (rb, fbn) = split(a), split(b)
    out = {}
    if 0 < fa + fbn < len(a) + len(b):
        out["fallback"] = chi2_contingency([[fa, len(a) - fa], [fbn, len(b) - fbn]])[1]
    else:  # both always (a wide photo at open_clip's scale) or both never fall back
        out["fallback"] = 1.0
    if min(len(ra), len(rb)) < 1000:
        return out

    def table(cols):
        pooled = np.concatenate(cols)
        codes = np.unique(pooled, return_inverse=True)[1]
        cut = [codes[:len(cols[0])], codes[len(cols[0]):]]
        counts = np.stack([np.bincount(c, minlength=codes.max() + 1) for c in cut])
        keep = counts.sum(0) >= 20
        rest = counts[:, ~keep].sum(1, keepdims=True)
        counts = np.concatenate([counts[:, keep], rest], 1) if rest.sum() else counts[:, keep]
        return chi2_contingency(counts)[1] if counts.shape[1] > 1 else 1.0

    def cells(x, edges):
        return np.searchsorted(edges, x, side="right")

    def feats(r):
        top, left, h, w = r.T
        return h * w / (width * height), np.log(w / h), top, left, h, w

    fa_, fb_ = feats(ra), feats(rb)
    area_edges = np.unique(np.quantile(np.concatenate([fa_[0], fb_[0]]), np.linspace(0, 1, 9)[1:-1]))
    asp_edges = np.unique(np.quantile(np.concatenate([fa_[1], fb_[1]]), np.linspace(0, 1, 9)[1:-1]))
    joint = [cells(f[0], area_edges) * 100 + cells(f[1], asp_edges) for f in (fa_, fb_)]
    out["area_aspect"] = table(joint)
    for name, pos, size, full in (("top", 2, 4, height), ("left", 3, 5, width)):
        rel = []
        for f in (fa_, fb_):
            room = full - f[size]
            m = room > 0
            rel.append(np.minimum((f[pos][m] / (room[m] + 1) * 10).astype(int), 9))
        out[name] = table(rel)
    return out


def ours(sampler: CropSampler, width: int, height: int, rng, n: int = OURS_DRAWS) -> list[Box]:
    return [sampler(width, height, rng) for _ in range(n)]


def _distribution(config, n_ours: int, n_ref: int):
    scale, ratio = config
    sampler = CropSampler(scale, ratio)
    for name, (w, h) in ASPECTS.items():
        p = p_values(ours(sampler, w, h, random.Random(1), n_ours), reference(w, h, scale, ratio, n_ref), w, h, ratio)
        assert min(p.values()) > ALPHA, (name, p)


@pytest.mark.parametrize("config", [OPEN_CLIP, TORCHVISION], ids=["open_clip", "torchvision"])
def test_crop_boxes_are_torchvisions_in_distribution(config):
    """50k of our draws per image aspect against 10k of torchvision's get_params (about 1 s per aspect;
    the mutants below are caught at these counts with p below 1e-26); test_crop_boxes_match_at_full_count
    runs 100k of each."""
    _distribution(config, OURS_DRAWS, REF_DRAWS)


@pytest.mark.slow
@pytest.mark.parametrize("config", [OPEN_CLIP, TORCHVISION, TIMM], ids=["open_clip", "torchvision", "timm"])
def test_crop_boxes_match_at_full_count(config):
    _distribution(config, 100_000, 100_000)


class _Mutant:
    """A random source that bends one draw, to show the test above would catch a wrong sampler."""

    def __init__(self, kind: str):
        self.r, self.kind, self.calls = random.Random(1), kind, 0

    def uniform(self, a, b):
        self.calls += 1
        if self.kind == "aspect_uniform" and self.calls % 2 == 0:  # aspect uniform, not log-uniform
            return math.log(self.r.uniform(math.exp(a), math.exp(b)))
        return self.r.uniform(a, b)

    def randrange(self, n):
        return self.r.randrange(max(1, n - 1) if self.kind == "position_short" else n)


@pytest.mark.parametrize("kind,aspect,stat", [("aspect_uniform", "1:1", "area_aspect"), ("position_short", "4:3", "top")])
def test_the_distribution_test_catches_a_wrong_sampler(kind, aspect, stat):
    scale, ratio = TORCHVISION if kind == "aspect_uniform" else OPEN_CLIP
    w, h = ASPECTS[aspect]
    sampler = CropSampler(scale, ratio)
    rng = _Mutant(kind)
    p = p_values(ours(sampler, w, h, rng), reference(w, h, scale, ratio, REF_DRAWS), w, h, ratio)
    assert p[stat] < 1e-6, p


def test_fallback_and_seeding():
    """A 3:2 photo at open_clip's scale never fits in ten tries: always the centre crop clamped to the
    ratio, as torchvision's; the same seed draws the same box, another seed another."""
    sampler = CropSampler(*OPEN_CLIP)
    assert {sampler(450, 300, random.Random(i)) for i in range(200)} == {Box(0, 25, 300, 400)}
    assert reference(450, 300, *OPEN_CLIP, 50) == [Box(0, 25, 300, 400)] * 50
    crop = ResizedCrop(224, *OPEN_CLIP)
    img = Image.new("RGB", (400, 400))
    assert crop.box(img, 7) == crop.box(img, 7)
    assert len({crop.box(img, s) for s in range(50)}) > 10
    with pytest.raises(ValueError, match="low <= high"):
        CropSampler((1.0, 0.5))


def _torchvision(data: bytes, box: Box, size) -> torch.Tensor:
    img = Image.open(io.BytesIO(data)).convert("RGB")
    return TF.pil_to_tensor(TF.resized_crop(img, *box, list(size), InterpolationMode.BICUBIC)).permute(1, 2, 0)


def _odd_images() -> list[bytes]:
    """A grayscale JPEG, a CMYK JPEG, a palette PNG with transparency, an RGBA PNG."""
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 255, (300, 420, 3), dtype=np.uint8)
    out = []
    for img, fmt in ((Image.fromarray(arr).convert("L"), "JPEG"), (Image.fromarray(arr).convert("CMYK"), "JPEG"),
                     (Image.fromarray(arr).convert("P"), "PNG"), (Image.fromarray(arr).convert("RGBA"), "PNG")):
        if img.mode == "P":
            img.info["transparency"] = 0
        buf = io.BytesIO()
        img.save(buf, fmt)
        out.append(buf.getvalue())
    return out


def test_full_size_pixels_are_torchvisions_bit_for_bit():
    """Without a decode reduction the crop is torchvision's resized_crop of the same box exactly, for
    photos, grayscale and CMYK JPEGs, palette and RGBA PNGs, square and non-square outputs."""
    images = [b for _, b in make_jpegs(24)] + _odd_images()
    for size in ((224, 224), (160, 192)):
        crop = ResizedCrop(size, *TORCHVISION, draft=False)
        for i, data in enumerate(images):
            box = crop.box(Image.open(io.BytesIO(data)), i)
            got = crop.apply(Image.open(io.BytesIO(data)), box)
            assert got.shape == (*size, 3) and got.dtype == torch.uint8
            assert torch.equal(got, _torchvision(data, box, size)), (size, i)


def test_reduced_decoding_is_within_tolerance():
    """A box at least 2x the output in both dimensions is decoded at a DCT reduction of 2, 4 or 8;
    against torchvision's full-size resized_crop of the same box: mean absolute difference <= 3 of 255
    and PSNR >= 33 dB per image (measured on these photos: mean 0.5-1.0, PSNR >= 36.6 dB)."""
    crop = ResizedCrop(224, *OPEN_CLIP)
    seen = set()
    for i, (_, data) in enumerate(make_jpegs(24, seed=3, short_side=(300, 2000))):
        box = crop.box(Image.open(io.BytesIO(data)), i)
        s = crop.reduction(Image.open(io.BytesIO(data)), box)
        assert s == max([1] + [k for k in (2, 4, 8) if box.height >= k * 224 and box.width >= k * 224])
        got, ref = crop.apply(Image.open(io.BytesIO(data)), box).float(), _torchvision(data, box, (224, 224)).float()
        mse = ((got - ref) ** 2).mean().item()
        assert (got - ref).abs().mean() <= 3 and (mse == 0 or 10 * math.log10(255 ** 2 / mse) >= 33), (i, s)
        seen.add(s)
    assert seen == {1, 2, 4, 8}


@pytest.mark.filterwarnings("ignore:Unused augmentation cfg items")
def test_only_open_clips_plain_augmentation_takes_the_fast_path():
    from open_clip.transform import AugmentationCfg, PreprocessCfg, image_transform_v2

    def fast(size=224, **aug):
        t = image_transform_v2(PreprocessCfg(size=size), is_train=True, aug_cfg=AugmentationCfg(**aug))
        return split_normalize(t, fast=True)

    crop, norm = fast()
    assert isinstance(crop, ResizedCrop) and norm.channels_last
    assert (crop.size, crop.sampler.scale, crop.sampler.ratio) == ((224, 224), (0.9, 1.0), (3 / 4, 4 / 3))
    crop, _ = fast(size=(160, 192), scale=(0.5, 1.0))
    assert crop.size == (160, 192) and crop.sampler.scale == (0.5, 1.0)
    for aug in ({"gray_scale_prob": 0.2}, {"color_jitter": (0.4, 0.4, 0.4, 0.1), "color_jitter_prob": 0.8}):
        kept, norm = fast(**aug)
        assert not isinstance(kept, ResizedCrop) and not norm.channels_last
    assert fast_train_transform(lambda im: im) is None


def test_device_normalize_permutes_channels_last_batches():
    x = torch.randint(0, 256, (2, 5, 7, 3), dtype=torch.uint8)
    mean, std = (0.1, 0.2, 0.3), (0.5, 0.6, 0.7)
    got = DeviceNormalize(mean, std, channels_last=True)(x)
    assert got.shape == (2, 3, 5, 7) and got.is_contiguous()
    assert torch.equal(got, DeviceNormalize(mean, std)(x.permute(0, 3, 1, 2).contiguous()))


def test_decoder_fast_path_counts_what_it_cannot_use():
    """Through SampleDecoder: the fast crop gives (H, W, 3) uint8; an image over max_pixels (its reduced
    size counts) and bytes that are not an image are counted skips, never a crash."""
    crop = ResizedCrop(64, *OPEN_CLIP)
    data = make_jpegs(1, short_side=(300, 300))[0][1]
    raw = {"__key__": "k", "jpg": data, "txt": b"a photo"}
    item = SampleDecoder(crop)(raw, 0, 0)
    assert item["image"].shape == (64, 64, 3) and item["image"].dtype == torch.uint8
    assert torch.equal(item["image"], SampleDecoder(crop)(raw, 0, 0)["image"])  # seeded by (seed, epoch, key)
    with pytest.raises(SkipSample) as e:
        SampleDecoder(crop, max_pixels=1000)(raw, 0, 0)
    assert e.value.reason == "too_many_pixels"
    with pytest.raises(SkipSample) as e:
        SampleDecoder(crop)({**raw, "jpg": data[: len(data) // 3]}, 0, 0)
    assert e.value.reason == "undecodable_image"


def test_aug_cfg_is_checked_before_training():
    """data.aug_cfg is open_clip's --aug-cfg: an unknown key, a bad scale, or a setting open_clip would
    warn about and ignore (ratio without use_timm) is a ConfigError naming it; scale alone keeps the
    fast path."""
    from types import SimpleNamespace

    from mmpretrain.config import ConfigError, load_config
    from mmpretrain.train.inputs import train_transform

    def cfg(*aug):
        return load_config(ROOT / "configs/tiny/clip.yaml", list(aug))

    model = SimpleNamespace(preprocess_cfg={"size": 32})
    crop, norm = train_transform(cfg("data.aug_cfg={scale: [0.5, 1.0]}"), model)
    assert isinstance(crop, ResizedCrop) and crop.sampler.scale == (0.5, 1.0) and norm.channels_last
    kept, norm = train_transform(cfg("data.aug_cfg={gray_scale_prob: 0.2}"), model)
    assert not isinstance(kept, ResizedCrop) and not norm.channels_last
    with pytest.raises(ConfigError, match=r"unknown data.aug_cfg key\(s\) \['scal'\]"):
        cfg("data.aug_cfg={scal: [0.5, 1.0]}")
    with pytest.raises(ConfigError, match="aug_cfg.scale must be two numbers"):
        cfg("data.aug_cfg={scale: [1.0, 0.5]}")
    with pytest.raises(ConfigError, match=r"ignores \[.ratio.\] without use_timm"):
        train_transform(cfg("data.aug_cfg={ratio: [0.5, 2.0]}"), model)
    with pytest.raises(ConfigError, match="color_jitter_prob"):  # open_clip: an assertion with no message
        train_transform(cfg("data.aug_cfg={color_jitter: 0.4, color_jitter_prob: 0.8}"), model)
    timm, _ = train_transform(cfg("data.aug_cfg={use_timm: true, scale: [0.5, 1.0], ratio: [0.5, 2.0]}"), model)
    assert not isinstance(timm, ResizedCrop)
