"""Task ``dense_probe``: what the frozen image tower's patch tokens know about where things are. A linear
probe (multinomial logistic regression, scikit-learn) on the last block's patch tokens (after the tower's
final norm: open_clip's ``forward_intermediates``) predicts each patch's label, the majority of its pixels'
labels in the sample's label map (``seg.png``, through the same resize and crop as the image, nearest
neighbour). The patch predictions, each spread over its pixels, are scored against the label map:

- ``dense_miou``: the mean over classes of ``|pred = c and true = c| / |pred = c or true = c|``, counted over
  every test pixel (classes that neither side holds are left out);
- ``dense_pixel_acc``: the share of test pixels labelled right; ``dense_patch_acc``: of patches.

C is chosen from :data:`C_GRID` on a 20 % validation split of the training images (by image: a patch's
neighbours are not its validation), then refit on every training patch (at most ``MAX_TRAIN_PATCHES``,
drawn with a fixed seed). Chance: the training patches' most frequent label predicted everywhere.
``demo:mnist`` and ``demo:openmoji`` write such sets (``DIR/dense``: the digits' strokes, the emoji's alpha).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mmpretrain.eval.context import EvalContext, batches, cat_or_empty, gather_in_order
from mmpretrain.eval.datasets import EvalDataset, EvalSample

C_GRID = (0.01, 0.1, 1.0, 10.0)
MAX_TRAIN_PATCHES = 200_000
_PLAIN = {"ToTensor", "Normalize", "MaybeToTensor", "ConvertImageDtype", "MaybeConvertMode", "_convert_to_rgb", "convert_to_rgb"}


class MaskTransform:
    """The image preprocess's geometry for a label map: each ``Resize`` with nearest-neighbour sampling, each
    ``CenterCrop`` as it is, colour and tensor steps left out; called on a label map it returns ``(H, W)`` int64
    class indices. Raises ValueError for a step whose geometry cannot be followed. (A class, not a closure: the
    loader's workers receive it pickled.)"""

    def __init__(self, preprocess):
        from torchvision import transforms as T

        self.steps = []
        for t in getattr(preprocess, "transforms", []):
            name = getattr(t, "__name__", type(t).__name__)
            if isinstance(t, T.Resize):
                self.steps.append(T.Resize(t.size, interpolation=T.InterpolationMode.NEAREST, max_size=t.max_size))
            elif isinstance(t, T.CenterCrop):
                self.steps.append(t)
            elif name not in _PLAIN:
                raise ValueError(f"dense_probe: the image preprocess has a {name} step whose geometry the label "
                                 "map cannot follow (Resize and CenterCrop can)")

    def __call__(self, mask) -> torch.Tensor:
        for step in self.steps:
            mask = step(mask)
        return torch.from_numpy(np.array(mask, dtype=np.int64))


class _Masked:
    """The dataset's samples with their transformed label map as the label (made in the loader's workers);
    a sample without one is skipped and counted (``missing_label_map``)."""

    def __init__(self, ds: EvalDataset, transform):
        self.ds, self.transform = ds, transform

    def __getattr__(self, name):
        if name == "ds":  # not set yet (unpickling in a worker)
            raise AttributeError(name)
        return getattr(self.ds, name)

    def indexed(self, rank: int = 0, world: int = 1, part: int = 0, parts: int = 1):
        for i, s in self.ds.indexed(rank, world, part, parts):
            if s.mask is None:
                yield i, EvalSample(s.key, None, [], -1, skip="missing_label_map")
            else:
                yield i, EvalSample(s.key, s.image, [], self.transform(s.mask))


def patch_tokens(visual, images: torch.Tensor) -> torch.Tensor:
    """``(B, D, h, w)``: the last block's patch tokens through the final norm."""
    if not hasattr(visual, "forward_intermediates") or not hasattr(visual, "patch_size"):
        raise ValueError(f"dense_probe reads an open_clip ViT's patch tokens; this image tower "
                         f"({type(visual).__name__}) has none")
    out = visual.forward_intermediates(images, indices=1, normalize_intermediates=True, intermediates_only=True)
    return out["image_intermediates"][-1]


def patch_labels(pixels: torch.Tensor, grid: tuple[int, int], num_classes: int) -> torch.Tensor:
    """``(B, h, w)``: the most frequent label of each patch's pixels in ``pixels (B, H, W)`` (ties to the
    smaller label)."""
    b, hh, ww = pixels.shape
    h, w = grid
    ph, pw = hh // h, ww // w
    blocks = pixels[:, :h * ph, :w * pw].reshape(b, h, ph, w, pw).permute(0, 1, 3, 2, 4).reshape(b, h, w, ph * pw)
    return F.one_hot(blocks, num_classes).sum(-2).argmax(-1)


def dense_metrics(pred: torch.Tensor, truth: torch.Tensor, num_classes: int) -> dict[str, float]:
    """``dense_miou`` and ``dense_pixel_acc`` of per-pixel predictions against ``truth`` (same shape)."""
    p, t = pred.flatten(), truth.flatten()
    confusion = torch.bincount(t * num_classes + p, minlength=num_classes ** 2).reshape(num_classes, num_classes)
    inter = confusion.diag().double()
    union = confusion.sum(0).double() + confusion.sum(1).double() - inter
    present = union > 0
    return {"dense_miou": (inter[present] / union[present]).mean().item(),
            "dense_pixel_acc": (inter.sum() / confusion.sum()).item()}


def spread(patch_pred: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Patch predictions ``(B, h, w)`` over the pixels ``(B, H, W)`` each patch covers (pixels past the last
    whole patch take the nearest patch's)."""
    b, h, w = patch_pred.shape
    hh, ww = size
    rows = torch.clamp(torch.arange(hh) // (hh // h), max=h - 1)
    cols = torch.clamp(torch.arange(ww) // (ww // w), max=w - 1)
    return patch_pred[:, rows][:, :, cols]


@torch.no_grad()
def _split(model, preprocess, ds: EvalDataset, ctx: EvalContext, num_classes: int):
    transform = MaskTransform(preprocess)
    index, feats, labels, pixels = [], [], [], []
    for idx, images, _, masks in batches(_Masked(ds, transform), preprocess, ctx, labelled_only=True,
                                         desc=f"{ds.name} patches"):
        tok = patch_tokens(model.visual, images.to(ctx.device)).float().cpu()  # (B, D, h, w)
        px = torch.stack(masks)
        if int(px.max()) >= num_classes or int(px.min()) < 0:
            raise ValueError(f"{ds.name}: a label map holds class {int(px.max())} but there are {num_classes} "
                             "class names (classnames.txt): give one name per label, background included")
        grid = tuple(tok.shape[-2:])
        feats.append(tok.flatten(2).transpose(1, 2))  # (B, h*w, D)
        labels.append(patch_labels(px, grid, num_classes).flatten(1))
        pixels.append(px.to(torch.uint8 if num_classes <= 256 else torch.int64))
        index.append(idx)
    local = {"feats": cat_or_empty(feats), "labels": cat_or_empty(labels, torch.long), "pixels": cat_or_empty(pixels)}
    out, _ = gather_in_order(local, cat_or_empty(index, torch.long), ctx.world_size)
    if out["feats"] is None:
        raise ValueError(f"{ds.name}: no samples with a label map (seg.png): dense_probe needs per-pixel labels "
                         "(python -m data_tools build demo:mnist or demo:openmoji writes DIR/dense)")
    return out["feats"], out["labels"], out["pixels"].long(), grid


def _fit(x: np.ndarray, y: np.ndarray, c: float):
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(C=c, max_iter=1000, random_state=0).fit(x, y)


def fit_probe(feats: torch.Tensor, labels: torch.Tensor, seed: int = 0) -> tuple[object, float]:
    """The probe on training patch features ``(N, P, D)`` and labels ``(N, P)``, C chosen on a 20 % split of
    the images; returns ``(classifier, C)``."""
    n, p, _ = feats.shape
    rng = np.random.default_rng(seed)
    val = np.zeros(n, dtype=bool)
    val[rng.permutation(n)[:max(1, n // 5)]] = True
    x, y = feats.numpy(), labels.numpy()

    def rows(mask):
        xs, ys = x[mask].reshape(-1, x.shape[-1]), y[mask].reshape(-1)
        if len(ys) > MAX_TRAIN_PATCHES:
            keep = rng.permutation(len(ys))[:MAX_TRAIN_PATCHES]
            xs, ys = xs[keep], ys[keep]
        return xs, ys

    xa, ya = rows(~val)
    xv, yv = x[val].reshape(-1, x.shape[-1]), y[val].reshape(-1)
    if len(np.unique(ya)) < 2:
        raise ValueError("dense_probe: the training patches hold one label only; the probe needs two or more")
    scores = {c: (_fit(xa, ya, c).predict(xv) == yv).mean() for c in C_GRID}
    best = max(C_GRID, key=lambda c: (scores[c], -c))
    xs, ys = rows(np.ones(n, dtype=bool))
    return _fit(xs, ys, best), best


def run(model, preprocess, tokenizer, splits: tuple[EvalDataset, EvalDataset], ctx: EvalContext) -> dict:
    train, test = splits
    classes = len(test.classnames or train.classnames or [])
    if classes < 2:
        raise ValueError(f"{test.name}: dense_probe needs the class names of the label maps (classnames.txt, "
                         "background first)")
    tr_x, tr_y, _, _ = _split(model, preprocess, train, ctx, classes)
    te_x, te_y, te_px, grid = _split(model, preprocess, test, ctx, classes)
    clf, best = fit_probe(tr_x, tr_y)
    pred = torch.from_numpy(clf.predict(te_x.reshape(-1, te_x.shape[-1]).numpy())).reshape(len(te_x), *grid)
    metrics = dense_metrics(spread(pred, tuple(te_px.shape[-2:])), te_px, classes)
    metrics["dense_patch_acc"] = (pred.flatten(1) == te_y).double().mean().item()
    common = int(torch.bincount(tr_y.flatten(), minlength=classes).argmax())
    chance = dense_metrics(torch.full_like(te_px, common), te_px, classes)
    chance["dense_patch_acc"] = (te_y == common).double().mean().item()
    return {"n": len(te_x), "n_train": len(tr_x), "metrics": metrics, "chance": chance, "C": best,
            "patches": list(grid)}
