"""Task ``captioning``: a CoCa model's generated caption for each image, scored against the image's own
captions (its ``txt`` lines: clip_benchmark's ``wds_mscoco_captions`` / ``wds_flickr*`` layouts, or our
shards) with the COCO caption metrics of ``pycocoevalcap`` (the package clip_benchmark's captioning task
scores with): ``Bleu_1`` .. ``Bleu_4``, ``ROUGE_L`` and ``CIDEr`` (CIDEr-D, as COCO reports it), under
those names.

Captions are tokenised as COCO's evaluation does, by Stanford's PTBTokenizer (the jar ships in
pycocoevalcap; it needs ``java``), lower-cased with punctuation removed. Without ``java`` on the PATH
:func:`ptb_tokenize_python` stands in and the entry says ``"tokenizer": "python"``: the same rules for
caption-like text (tests/test_captioning.py compares the two), not the full PTB grammar. METEOR and SPICE
are left out: SPICE downloads Stanford CoreNLP at first use, and METEOR starts a 2 GB Java process.

Generation is :func:`mmpretrain.models.caption.generate` (greedy, or beam search with ``num_beams``):
open_clip 3.3's ``CoCa.generate`` does not run under transformers 5.
"""

from __future__ import annotations

import re
import shutil
import sys

import torch

from mmpretrain.eval.context import EvalContext, batches, cat_or_empty, gather_in_order
from mmpretrain.eval.datasets import EvalDataset

METRICS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "ROUGE_L", "CIDEr")
# the tokens pycocoevalcap's PTBTokenizer drops after tokenising
PUNCTUATIONS = {"''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-", ".", "?", "!", ",", ":", "-", "--",
                "...", ";"}
# PTB writes brackets as -LRB- ...; lower-cased (-lowerCase) they no longer match PUNCTUATIONS and stay in
_BRACKETS = {"(": "-lrb-", ")": "-rrb-", "[": "-lsb-", "]": "-rsb-", "{": "-lcb-", "}": "-rcb-"}
_CLITIC = re.compile(r"(?i)(\w)(n't|'s|'re|'ve|'ll|'d|'m)(?=\W|$)")
_PUNCT = re.compile(r"(\.\.\.|--|[.,!?;:\"()\[\]{}]|(?<!\w)['`]+|['`]+(?!\w))")


def ptb_tokenize_python(text: str) -> str:
    """PTBTokenizer's output for caption-like text, as pycocoevalcap keeps it: lower-cased, punctuation
    split off and dropped, clitics (``n't``, ``'s``, ...) split into tokens of their own, hyphenated words
    kept whole, brackets kept as PTB names them lower-cased (``-lrb-``: COCO's scores count them)."""
    text = _PUNCT.sub(r" \1 ", text.lower().replace("\n", " "))
    text = _CLITIC.sub(r"\1 \2", text)
    return " ".join(_BRACKETS.get(t, t) for t in text.split() if t not in PUNCTUATIONS and t != '"')


def tokenize(captions: dict[int, list[str]], tokenizer: str) -> dict[int, list[str]]:
    """``{id: [caption, ...]}`` tokenised by ``"ptb"`` (pycocoevalcap's PTBTokenizer, java) or ``"python"``."""
    if tokenizer == "python":
        return {k: [ptb_tokenize_python(c) for c in v] for k, v in captions.items()}
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    return PTBTokenizer().tokenize({k: [{"caption": c} for c in v] for k, v in captions.items()})


def default_tokenizer() -> str:
    return "ptb" if shutil.which("java") else "python"


def caption_scores(references: list[list[str]], candidates: list[str], tokenizer: str | None = None) -> dict[str, float]:
    """The corpus metrics of ``candidates[i]`` against ``references[i]`` (one or more each), as pycocoevalcap's
    ``COCOEvalCap`` computes them (its tokenizer, then ``Bleu(4)``, ``Rouge``, ``Cider``)."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    if len(references) != len(candidates) or not candidates:
        raise ValueError(f"caption_scores: {len(candidates)} captions for {len(references)} reference lists")
    kind = tokenizer or default_tokenizer()
    gts = tokenize(dict(enumerate(references)), kind)
    res = tokenize({i: [c] for i, c in enumerate(candidates)}, kind)
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    out = {f"Bleu_{n + 1}": float(b) for n, b in enumerate(bleu)}
    out["ROUGE_L"] = float(Rouge().compute_score(gts, res)[0])
    out["CIDEr"] = float(Cider().compute_score(gts, res)[0])
    return out


def check_captioner(model, tokenizer) -> None:
    """A model that can caption, with a tokenizer that names its start and end tokens (raises ValueError)."""
    if not hasattr(model, "text_decoder"):
        raise ValueError("--task captioning needs a model with a caption decoder: a CoCa model (trained with the "
                         "caption objective, or an open_clip coca_* architecture)")
    try:
        import pycocoevalcap  # noqa: F401
    except ImportError:
        raise ValueError("--task captioning scores with pycocoevalcap: pip install 'simpretrain[captioning]'") from None
    if not all(hasattr(tokenizer, a) for a in ("sot_token_id", "eot_token_id", "decode")):
        raise ValueError(f"--task captioning: the model's tokenizer ({type(tokenizer).__name__}) does not name its "
                         "start and end tokens; captioning takes open_clip's CLIP tokenizer")


@torch.no_grad()
def run(model, preprocess, tokenizer, ds: EvalDataset, ctx: EvalContext) -> dict:
    from mmpretrain.models.caption import decode_captions, generate

    check_captioner(model, tokenizer)
    opts = {"num_beams": 6, "max_len": 30, "min_len": 5, **(ctx.generation or {})}
    context = getattr(getattr(model, "text", None), "num_pos", None)
    if context is not None and opts["max_len"] >= context:  # the text tower adds its CLS position
        opts["max_len"] = context - 1
    sot, eot = tokenizer.sot_token_id, tokenizer.eot_token_id
    index, generated, refs = [], [], []
    for idx, images, captions, _ in batches(ds, preprocess, ctx, desc=f"{ds.name} captioning"):
        ids = generate(model, images.to(ctx.device), sot=sot, eot=eot, pad=getattr(model, "pad_id", 0), **opts)
        generated += decode_captions(ids.cpu(), tokenizer, sot, eot)
        refs += captions
        index.append(idx)
    out, order = gather_in_order({"generated": generated, "refs": refs}, cat_or_empty(index, torch.long), ctx.world_size)
    pairs = [(g, r) for g, r in zip(out["generated"], out["refs"]) if r]
    if not pairs:
        raise ValueError(f"{ds.name}: no reference captions to score against: its samples need a txt member "
                         "(one caption per line)")
    references, candidates = [r for _, r in pairs], [g for g, _ in pairs]
    kind = default_tokenizer()
    try:
        metrics = caption_scores(references, candidates, kind)
    except OSError as e:  # PTBTokenizer writes a temporary file into pycocoevalcap's folder, then runs java
        if ctx.rank == 0:
            print(f"warning: {ds.name} captioning: PTBTokenizer failed ({e}); tokenising in Python instead",
                  file=sys.stderr)
        kind = "python"
        metrics = caption_scores(references, candidates, kind)
    samples = [{"index": int(i), "caption": g, "references": r}
               for i, g, r in zip(order.tolist(), out["generated"], out["refs"])]
    return {"n": len(pairs), "metrics": metrics, "chance": {}, "tokenizer": kind,
            "generation": {k: opts[k] for k in ("num_beams", "max_len", "min_len")}, "captions": samples}


def write_captions(results: str, entry: dict, rows: list[dict]) -> str:
    """The generated captions beside ``results`` (``RESULTS_captions_DATASET.jsonl``), one JSON line per
    image: its index in the dataset, the caption, its references; written whole, then renamed into place."""
    import json
    from pathlib import Path

    out = Path(results)
    safe = re.sub(r"[^\w.@-]+", "_", f"{entry['dataset']}")
    path = out.with_name(f"{out.stem}_captions_{safe}.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)
    return str(path)
