"""The NaFlex model's transformers export (mmpretrain/export/siglip2.py): Siglip2Model.from_pretrained loads
the folder, and its image and text features equal ours within 1e-5; what Siglip2 cannot express is refused."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import mmpretrain.models.naflex  # noqa: F401  (registers mmpt_naflexvit_tiny with timm)
from mmpretrain.data import naflex
from mmpretrain.export.hf import Unsupported
from mmpretrain.export.siglip2 import save_siglip2, to_siglip2
from mmpretrain.models.factory import (
    instantiate,
    make_tokenizer,
    register_packaged_configs,
    resolve_model_cfg,
)

MEAN = STD = (0.5, 0.5, 0.5)


@pytest.fixture(scope="module")
def model():
    register_packaged_configs()
    cfg = resolve_model_cfg("mmpt-tiny-naflex")
    torch.manual_seed(0)
    clip = instantiate(cfg, load_text_weights=True).eval()
    with torch.no_grad():  # away from the initialisation (zero biases, unit norms): every weight matters
        for p in clip.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return clip, cfg


def _inputs(seq_len: int):
    rng = np.random.default_rng(0)
    imgs = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(32, 32), (20, 60), (70, 10)]]
    per = [naflex.image_patches(im, seq_len, 8) for im in imgs]
    patches, coord, valid = naflex.pack([p for p, _ in per], [g for _, g in per], seq_len)
    x = naflex.normalize_patches(patches, torch.tensor(MEAN), torch.tensor(STD))
    return imgs, x, coord, valid, torch.tensor([g for _, g in per])


@pytest.mark.parametrize("seq_len", [4, 16, 37])
def test_siglip2_from_pretrained_gives_our_features(model, tmp_path, seq_len):
    from transformers import AutoImageProcessor, CLIPTokenizer, Siglip2Model

    clip, cfg = model
    save_siglip2(clip, cfg, {"mean": MEAN, "std": STD, "naflex_seq_len": seq_len}, tmp_path)
    hf = Siglip2Model.from_pretrained(str(tmp_path)).eval()
    imgs, x, coord, valid, shapes = _inputs(seq_len)
    tokens = make_tokenizer(cfg)(["a cat", "two dogs on a red sofa", "x"])
    with torch.no_grad():
        ours_i = clip.encode_image({"patches": x, "patch_coord": coord, "patch_valid": valid}, normalize=True)
        ours_t = clip.encode_text(tokens, normalize=True)
        out = hf(input_ids=tokens, pixel_values=x, pixel_attention_mask=valid.long(), spatial_shapes=shapes)
    torch.testing.assert_close(out.image_embeds, ours_i, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.text_embeds, ours_t, atol=1e-5, rtol=0)
    logits = ours_t @ ours_i.T * clip.logit_scale.exp() + clip.logit_bias
    torch.testing.assert_close(out.logits_per_text, logits, atol=1e-4, rtol=0)
    # the saved image processor: the same grids and mask as training's, pixels within its resize's rounding
    batch = AutoImageProcessor.from_pretrained(str(tmp_path))(imgs, return_tensors="pt")
    assert torch.equal(batch["spatial_shapes"], shapes)
    assert torch.equal(batch["pixel_attention_mask"].bool(), valid)
    assert ((batch["pixel_values"] - x).abs() * valid[..., None]).max() < 0.1  # padding: theirs 0, ours -1, masked
    # CLIPTokenizer by name: transformers 5's AutoTokenizer takes a siglip2 folder's tokenizer to be Gemma's
    tok = CLIPTokenizer.from_pretrained(str(tmp_path))
    both = tok(["a cat", "two dogs on a red sofa", "x"], padding="max_length", return_tensors="pt")
    assert torch.equal(both["input_ids"], tokens)  # CLIP's BPE, padded with 0 to the context as in training


def test_the_image_tower_alone_is_a_siglip2_vision_model(model, tmp_path):
    from transformers import Siglip2VisionModel

    clip, cfg = model
    save_siglip2(clip, cfg, {"mean": MEAN, "std": STD}, tmp_path, towers="image")
    hf = Siglip2VisionModel.from_pretrained(str(tmp_path)).eval()
    _, x, coord, valid, shapes = _inputs(16)
    with torch.no_grad():
        ours = clip.encode_image({"patches": x, "patch_coord": coord, "patch_valid": valid})
        theirs = hf(pixel_values=x, pixel_attention_mask=valid.long(), spatial_shapes=shapes).pooler_output
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert F.cosine_similarity(theirs, ours).min() > 0.9999


def test_what_siglip2_cannot_express_is_refused(model):
    clip, cfg = model
    causal = {**cfg, "text_cfg": {**cfg["text_cfg"], "pool_type": "argmax"}}
    with pytest.raises(Unsupported, match="pool the last position"):
        to_siglip2(clip, causal, {})
    with pytest.raises(Unsupported, match="embed_dim 32 is not the image width 64"):
        to_siglip2(clip, {**cfg, "embed_dim": 32}, {})
