"""A Hugging Face dataset (a ``save_to_disk`` folder or ``hf:NAME[:SPLIT]``) as a build source."""

from __future__ import annotations

from data_tools.sources.records import (
    MISSING_FILE,
    RangeSource,
    Record,
    SourceError,
    caption_lists,
    read_source_file,
)


class HFSource(RangeSource):
    """A Hugging Face dataset: a folder saved with ``save_to_disk`` or ``hf:NAME[:SPLIT]``."""

    kind = "hf"

    def __init__(self, spec: str, image_column: str, caption_column: str, extra_column: str | None = None,
                 negative_column: str | None = None):
        self.spec, self.image_column, self.caption_column = spec, image_column, caption_column
        self.extra_column, self.negative_column = extra_column, negative_column
        self._ds = None
        ds = self._dataset()
        missing = [c for c in (image_column, caption_column, extra_column, negative_column)
                   if c and c not in ds.column_names]
        if missing:
            raise SourceError(f"{spec}: column(s) {missing} not found; columns are {ds.column_names} (choose with "
                              "--image-column / --caption-column / --extra-captions-column / --negative-captions-column)")

    def _dataset(self):
        if self._ds is None:
            import datasets

            try:
                if self.spec.startswith("hf:"):
                    name, _, split = self.spec[3:].partition(":")
                    ds = datasets.load_dataset(name, split=split or "train")
                else:
                    ds = datasets.load_from_disk(self.spec)
                    if isinstance(ds, datasets.DatasetDict):
                        raise SourceError(f"{self.spec}: a DatasetDict; build one split folder ({list(ds)})")
            except SourceError:
                raise
            except Exception as e:
                raise SourceError(f"{self.spec}: cannot load the dataset ({e})") from None
            if isinstance(ds.features.get(self.image_column), datasets.Image):
                ds = ds.cast_column(self.image_column, datasets.Image(decode=False))  # raw bytes: we decode
            self._ds = ds
        return self._ds

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_ds"] = None
        return state

    def __len__(self) -> int:
        return len(self._dataset())

    def keys(self) -> list[str]:
        return [f"{i:09d}" for i in range(len(self))]

    def record(self, i: int) -> Record:
        row = self._dataset()[i]
        img = row[self.image_column]
        data, error = img, None  # a PIL image or None
        if isinstance(img, dict):
            data = img.get("bytes")
            if data is None and img.get("path"):
                data, error = read_source_file(img["path"])
        elif isinstance(img, str):
            data, error = read_source_file(img)
        meta = {"source_row": i}
        bad = caption_lists(meta, row, {"captions": self.extra_column, "negative_captions": self.negative_column})
        if bad:
            return Record(f"{i:09d}", caption=row[self.caption_column], meta=meta, error=bad)
        return Record(f"{i:09d}", image=data, caption=row[self.caption_column], meta=meta,
                      error=error or (MISSING_FILE if data is None else None))
