"""The images' way from the loader to the model, built once per run (:func:`mmpretrain.train.run_setup.setup`).

:class:`ImageInput` holds the loader's image transform (what the workers run), :class:`~mmpretrain.data.
decode.DeviceNormalize` (uint8 batches normalised on the device) and, with ``data.decode=device``, the
:class:`~mmpretrain.data.device_decode.DeviceDecoder`. The loader builder takes its ``transform`` and
``device_decode``; ``fit`` iterates :meth:`ImageInput.batches` (decoded ahead on a background thread
with the device decoder); ``train_step`` turns a batch into the model's input with :meth:`ImageInput.
__call__`, whichever way the batch came.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mmpretrain.data.batch import Batch
from mmpretrain.data.device_decode import DeviceDecoder, Prefetcher
from mmpretrain.data.naflex import host_grids, with_grids
from mmpretrain.data.transfer import to_device


class ImageInput:
    """``transform``: the loader's; ``normalize``: None when the transform ends normalised; ``decoder``:
    the device decoder (``data.decode=device``) or None; ``channels_last``, ``dtype``: the model input's
    memory format and dtype (DeepSpeed's half-precision weights; None: as the batch)."""

    def __init__(self, transform=None, normalize=None, decoder: DeviceDecoder | None = None, channels_last: bool = False,
                 dtype: torch.dtype | None = None):
        self.transform, self.normalize, self.decoder = transform, normalize, decoder
        self.channels_last, self.dtype = channels_last, dtype

    @property
    def device_decode(self) -> bool:
        """Whether the workers hand JPEGs over undecoded (the loader's SampleDecoder reads this)."""
        return self.decoder is not None

    def batches(self, loader) -> Iterator[Batch]:
        """The loader's batches as the step takes them: with the device decoder, decoded one batch ahead
        on a background thread (:class:`~mmpretrain.data.device_decode.Prefetcher`)."""
        return Prefetcher(loader, self.decoder) if self.decoder is not None else iter(loader)

    def __call__(self, batch: Batch, device: torch.device) -> torch.Tensor | dict[str, torch.Tensor]:
        """The model's input for ``batch``: on ``device``, normalised, in the run's layout and dtype. A batch
        not decoded ahead (a direct ``train_step`` call) is decoded here."""
        if self.decoder is not None and (batch.jpeg is not None or batch.images is None
                                         or batch.images.dtype == torch.uint8):
            self.decoder(batch)
        images = to_device(batch.images, device)
        if self.normalize is not None:  # uint8 from the loader (a quarter of the bytes); float passes as is
            images = self.normalize(images)
        if self.dtype is not None:  # DeepSpeed's bf16/fp16 weights; accelerate's autocast is off there
            images = images.to(self.dtype)
        if batch.patch_coord is not None:  # data.naflex: the NaFlexVit tower's input (mmpretrain.data.naflex)
            coord = with_grids(to_device(batch.patch_coord, device), host_grids(batch.patch_coord))
            return {"patches": images, "patch_coord": coord, "patch_valid": to_device(batch.patch_valid, device)}
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images
