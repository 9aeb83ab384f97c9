"""mmpretrain: image-text pretraining with similarity targets.

The library (``losses``, ``models``, ``data``, ``eval``) never imports the trainer; ``train`` and
``export`` are entry points on top of it.
"""

__version__ = "0.1.0"


def load(path: str, device: str = "cpu"):
    """Load ``(model, preprocess, tokenizer)`` from a run folder or an export folder.

    ``model`` is an open_clip model (``encode_image``/``encode_text``), ``preprocess`` the eval
    image transform, ``tokenizer`` the matching open_clip tokenizer.
    """
    from mmpretrain.models.from_disk import load_model

    try:
        return load_model(path, device=device)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{path}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
