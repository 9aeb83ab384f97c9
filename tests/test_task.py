"""The training task and the typed batch: an objective's declared needs reach its forward as exactly the
batch fields that serve them, by name; every per-sample field is collated from its item key and copied
when a slot repeats another; a misspelt need fails where it is declared."""

from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch

from mmpretrain.data.batch import Batch, batch_needs, collate
from mmpretrain.losses import LOSSES, NEEDS, build_objective
from mmpretrain.losses.base import Objective, class_needs
from mmpretrain.train.task import TrainingTask


class _Images:
    """The image input's part the task calls: the batch's images on the device."""

    def __call__(self, batch, device):
        return batch.images.to(device)


class _Accelerator:
    device = torch.device("cpu")


def _items(n=4, negatives=False):
    out = []
    for i in range(n):
        it = {"text": f"caption {i}", "key": f"k{i}", "index": 10 + i, "image": torch.full((3, 2, 2), float(i)),
              "emb": torch.full((5,), float(i)), "label": i % 2, "teacher_image": torch.full((6,), float(i)),
              "teacher_text": torch.full((6,), -float(i))}
        if negatives:
            it["negative"] = None if i == 1 else f"negative {i}"
        out.append(it)
    return out


def _tokenizer(texts):
    """Words as ids, zero-padded to 8 (like open_clip's tokenizers: 0 is padding)."""
    rows = [[len(w) for w in t.split()] for t in texts]
    return torch.tensor([r + [0] * (8 - len(r)) for r in rows])


def _objective(needs, encodings=None):
    return SimpleNamespace(needs=frozenset(needs), encodings=encodings)


def test_every_objective_declares_known_needs_and_a_typo_fails_at_the_class():
    for name, cls in LOSSES.items():
        assert class_needs(cls) <= NEEDS.keys(), name
    assert batch_needs().keys() <= NEEDS.keys() and {"labels", "sample_index", "teacher", "negatives"} <= NEEDS.keys()
    with pytest.raises(TypeError, match="unknown need.*'label'"):
        type("Typo", (Objective,), {"name": "typo", "needs": frozenset({"label"})})
    built = build_objective([{"name": "clip", "options": {"hard_negatives": True}},
                             {"name": "regions", "options": {"base": "soft_target", "space": "target"}}])
    assert built.needs == {"negatives", "labels", "targets"}  # the terms' union, a wrapper's included
    assert build_objective([{"name": "resa"}]).encodings == "online"
    with pytest.raises(ValueError, match="nothing provides"):
        TrainingTask(_objective({"no_such_need"}))


def test_collate_fills_every_declared_field_from_its_item_key():
    batch = collate(_items(negatives=True), _tokenizer)
    assert batch.keys == ["k0", "k1", "k2", "k3"] and batch.sample_index.tolist() == [10, 11, 12, 13]
    assert batch.labels.dtype == torch.long and batch.labels.tolist() == [0, 1, 0, 1]
    assert torch.equal(batch.target_embeddings[:, 0], torch.arange(4.0))
    assert torch.equal(batch.teacher_text_embeddings[:, 0], -torch.arange(4.0))
    assert batch.negative_mask.tolist() == [True, False, True, True] and batch.negative_tokens.shape == (4, 8)
    assert batch.jpeg is None and batch.images.shape == (4, 3, 2, 2)
    # a field every item lacks stays None (an objective that needs it would get nothing: the decoder makes it)
    assert collate([{k: v for k, v in it.items() if k != "label"} for it in _items()]).labels is None


def test_copy_row_copies_every_per_sample_field():
    batch = collate(_items(negatives=True), _tokenizer)
    batch.copy_row(2, 0)
    for f in fields(Batch):
        value = getattr(batch, f.name)
        if f.metadata.get("row") and value is not None:
            assert (value[2] == value[0]) if isinstance(value, list) else torch.equal(value[2], value[0]), f.name


@pytest.mark.parametrize("needs", [set(), {"labels"}, {"sample_index", "labels"}, {"teacher"}, {"negatives"}])
def test_the_task_hands_the_objective_exactly_the_fields_of_its_needs(needs):
    batch = collate(_items(negatives="negatives" in needs), _tokenizer)
    batch.epoch = 2
    task = TrainingTask(_objective(needs), _Images(), trim_text=True, text_length_multiple=2, teacher_dims=[6])
    got = task.inputs(batch, 7, _Accelerator(), model=None)
    want = {"step", "epoch"} | {f.name for f in fields(Batch) if f.metadata.get("need") in needs}
    assert set(got.context) - {"teacher_dims"} == want
    assert got.context["step"] == 7 and got.context["epoch"] == 3  # 1-based
    assert ("teacher_dims" in got.context) == ("teacher" in needs)
    for name in want - {"step", "epoch"}:
        assert torch.equal(got.context[name], getattr(batch, name))
    assert torch.equal(got.target_embeddings, batch.target_embeddings)  # the model's (text_from_targets) input
    assert not got.encodings
    if "negatives" in needs:  # one text pass: both cut to the longer of the two, on the host
        used = max(int((batch.tokens != 0).sum(1).max()), int((batch.negative_tokens != 0).sum(1).max()))
        assert got.tokens.shape[1] == got.negative_tokens.shape[1] == used + used % 2
    else:
        assert got.negative_tokens is None and got.tokens.shape[1] == 2  # "caption i": 2 tokens


def test_image_encodings_come_from_the_model_or_the_average():
    batch = collate(_items(), _tokenizer)
    online = TrainingTask(_objective({"image_encodings"}, "online"), _Images())
    assert online.inputs(batch, 0, _Accelerator(), None).encodings

    class _Ema:
        def encodings(self, model, images):
            return images.flatten(1)[:, :3]

    class _Acc(_Accelerator):
        def autocast(self):
            return torch.autocast("cpu", enabled=False)

        def unwrap_model(self, model):
            return model

    ema = TrainingTask(_objective({"image_encodings"}, "ema"), _Images(), ema=_Ema()).inputs(batch, 0, _Acc(), None)
    assert not ema.encodings and ema.context["image_encodings"].shape == (4, 3)
