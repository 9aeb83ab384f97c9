"""clip_benchmark (the tool users compare with) run on the same model and dataset, for the agreement
tests and ``scripts/bench_eval.py``.

clip_benchmark 1.6.2 needs two fixes here, neither touching its numbers: it imports ``requests``
without declaring it (a dev dependency of this project), and its top-k helper calls ``float()`` on a
1-element array, which numpy 2.4 refuses; ``_accuracy`` is the same computation returning a scalar."""

from __future__ import annotations

from pathlib import Path

import torch


def _accuracy(output: torch.Tensor, target: torch.Tensor, topk=(1,)) -> list[float]:
    pred = output.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    n = len(target)
    return [float(correct[:k].reshape(-1).float().sum().item()) / n for k in topk]


def clip_benchmark_eval(model, preprocess, tokenizer, root: str | Path, task: str, *, batch_size: int = 256,
                        num_workers: int = 0, device: str = "cpu", recall_k: list[int] | None = None,
                        templates: list[str] | None = None) -> dict[str, float]:
    """clip_benchmark's own ``evaluate`` for ``task`` on its ``wds`` layout at ``root`` (fp32, no amp)."""
    from clip_benchmark.datasets.builder import build_dataset
    from clip_benchmark.metrics import zeroshot_classification, zeroshot_retrieval

    zeroshot_classification.accuracy = _accuracy
    name = "wds/" + Path(root).name
    ds = build_dataset(name, root=str(root), transform=preprocess, split="test", download=False, task=task)
    # as clip_benchmark's CLI builds it for a wds dataset
    loader = torch.utils.data.DataLoader(ds.batched(batch_size), batch_size=None, shuffle=False,
                                         num_workers=num_workers)
    model.eval()
    if task == "zeroshot_classification":
        # clip_benchmark formats templates with .format(c=...); ours use the same {c} placeholder
        return zeroshot_classification.evaluate(model, loader, tokenizer, ds.classes, templates or ds.templates,
                                                device, amp=False)
    if task == "zeroshot_retrieval":
        return zeroshot_retrieval.evaluate(model, loader, tokenizer, device, amp=False,
                                           recall_k_list=recall_k or [1, 5, 10])
    raise ValueError(f"clip_benchmark comparison covers zero-shot classification and retrieval, not {task!r}")


def clip_benchmark_cli(*argv: str) -> dict:
    """``clip_benchmark eval ARGV --output FILE`` in this process (its own argument parsing, model
    loading and dataset building); the metrics it writes."""
    import json
    import sys
    import tempfile

    from clip_benchmark import cli

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "result.json"
        saved = sys.argv
        sys.argv = ["clip_benchmark", "eval", *argv, "--output", str(out)]
        try:
            cli.main()
        finally:
            sys.argv = saved
        return json.loads(out.read_text())["metrics"]


def clip_benchmark_winoground(model, preprocess, tokenizer, saved: str | Path, *, batch_size: int = 64) -> dict:
    """clip_benchmark's ``WinoGround`` dataset and ``image_caption_selection.evaluate`` (fp32, no amp) on a
    ``save_to_disk`` copy: its dataset class loads ``facebook/winoground`` from the Hub, so the loaded
    copy takes the place of that one call; everything after it is clip_benchmark's."""
    import datasets
    from clip_benchmark.datasets.builder import image_captions_collate_fn
    from clip_benchmark.datasets.winoground import WinoGround
    from clip_benchmark.metrics import image_caption_selection

    ds = WinoGround.__new__(WinoGround)
    ds.ds, ds.transform = datasets.load_from_disk(str(saved))["test"], preprocess
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=False, collate_fn=image_captions_collate_fn)
    model.eval()
    return image_caption_selection.evaluate(model, loader, tokenizer, "cpu", amp=False)
