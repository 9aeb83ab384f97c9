"""The caption decoder beside the contrastive towers: open_clip's ``CoCa`` (Yu et al., 2022, "CoCa:
Contrastive Captioners are Image-Text Foundation Models"), a causal text decoder (open_clip's
``MultimodalTransformer``) cross-attending to the image tower's tokens, built for an arch with a
``multimodal_cfg`` (``mmpt-tiny-coca``, open_clip's ``coca_ViT-B-32``). ``DualEncoder.forward(...,
caption=True)`` returns :func:`caption_outputs`, which the ``caption`` objective
(:mod:`mmpretrain.losses.caption`) scores.
"""

from __future__ import annotations

import torch
from torch import nn


def is_coca(model_cfg: dict) -> bool:
    """Whether a model config is open_clip's CoCa (a ``multimodal_cfg``: the caption decoder)."""
    return "multimodal_cfg" in model_cfg


def decoder_shape(model_cfg: dict) -> tuple[int, int]:
    """``(context_length, vocab_size)`` of a CoCa config's caption decoder: the tokens it reads and the ids
    it scores (the caption objective's logits are ``(B, context_length - 1, vocab_size)``)."""
    text, mm = model_cfg.get("text_cfg", {}), model_cfg["multimodal_cfg"]
    return text.get("context_length", 77), mm.get("vocab_size", text.get("vocab_size", 49408))


def init_decoder(coca: nn.Module) -> nn.Module:
    """open_clip 3.3's CoCa never initialises its decoder: ``MultimodalTransformer.init_parameters`` reads a
    ``self.transformer`` it does not have, so nothing calls it, and the vocabulary projection stays
    ``torch.empty`` (whatever memory held: zeros, which stop every gradient below it at the first step, or
    garbage; open_clip issue #554). This is that method as written, on the decoder's own width and depth."""
    dec = coca.text_decoder
    proj_std = dec.width ** -0.5 * (2 * dec.layers) ** -0.5
    attn_std, fc_std = dec.width ** -0.5, (2 * dec.width) ** -0.5
    with torch.no_grad():
        for block in [*dec.resblocks, *dec.cross_attn]:
            nn.init.normal_(block.attn.in_proj_weight, std=attn_std)
            nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
            nn.init.normal_(block.mlp.c_fc.weight, std=fc_std)
            nn.init.normal_(block.mlp.c_proj.weight, std=proj_std)
        nn.init.normal_(dec.text_projection, std=dec.width ** -0.5)
    return coca


def caption_outputs(coca: nn.Module, images: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """open_clip ``CoCa.forward``'s features for the caption objective: normalised ``image_features`` and
    ``text_features``, the decoder's ``caption_logits (B, L-1, V)`` over the image tokens (the attentional
    pooler's queries) and the text tower's token outputs of ``tokens[:, :-1]``, ``caption_labels =
    tokens[:, 1:]`` (padding, id ``coca.pad_id``, is the objective's to ignore). The same computation as
    ``CoCa.forward``, so ``open_clip.loss.CoCaLoss`` on its outputs is the reference."""
    if not hasattr(coca, "text_decoder"):
        raise ValueError("the caption objective needs a caption decoder: a CoCa arch (a multimodal_cfg, e.g. "
                         "mmpt-tiny-coca or coca_ViT-B-32)")
    image_features, image_tokens = coca._encode_image(images, normalize=True)
    text_features, token_embs = coca._encode_text(tokens, normalize=True)
    return {"image_features": image_features, "text_features": text_features,
            "caption_logits": coca.text_decoder(image_tokens, token_embs[:, :-1]), "caption_labels": tokens[:, 1:]}


# Caption generation. open_clip 3.3's ``CoCa.generate`` cannot run under transformers 5 (here and on the GPU
# image): it imports ``BeamSearchScorer``, which transformers 5 removed, and that failed import turns off every
# generation type (``assert _has_transformers``). This is greedy and beam search over the same decoder.

def next_logprobs(coca: nn.Module, image_embs: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """log-probabilities ``(N, V)`` (float32) of the token after each ``prefix (N, t)``, given the image
    tower's tokens ``image_embs (N, Q, W)``: the text tower's causal token outputs through the decoder, as
    ``CoCa.forward`` computes them, at the last position."""
    _, token_embs = coca._encode_text(prefix, normalize=False)
    return coca.text_decoder(image_embs, token_embs)[:, -1].float().log_softmax(-1)


@torch.no_grad()
def generate(coca: nn.Module, images: torch.Tensor, *, sot: int, eot: int, pad: int = 0, max_len: int = 30,
             min_len: int = 5, num_beams: int = 1, length_penalty: float = 1.0) -> torch.Tensor:
    """Token ids ``(B, T <= max_len)`` for ``images``, each row ``sot ... eot`` then ``pad``. ``eot`` is
    barred while a row holds fewer than ``min_len`` tokens (transformers' ``MinLengthLogitsProcessor``) and
    forced at ``max_len``. ``num_beams == 1``: greedy; else beam search: every step keeps the ``num_beams``
    highest summed log-probabilities per image, a beam that ends is a hypothesis scored ``sum / length **
    length_penalty`` (length in tokens, ``sot`` and ``eot`` included), and an image is done once it holds
    ``num_beams`` hypotheses none of its running beams can beat (transformers' ``BeamHypotheses``)."""
    if not hasattr(coca, "text_decoder"):
        raise ValueError("caption generation needs a caption decoder: a CoCa model (a multimodal_cfg)")
    if not 2 <= min_len + 1 <= max_len or num_beams < 1:
        raise ValueError(f"generate: need 1 <= min_len < max_len and num_beams >= 1 (got min_len={min_len}, "
                         f"max_len={max_len}, num_beams={num_beams})")
    was_training = coca.training
    coca.eval()
    try:
        _, image_embs = coca._encode_image(images, normalize=False)
        if num_beams == 1:
            return _greedy(coca, image_embs, sot, eot, pad, max_len, min_len)
        return _beam(coca, image_embs, sot, eot, pad, max_len, min_len, num_beams, length_penalty)
    finally:
        coca.train(was_training)


def _greedy(coca, image_embs, sot, eot, pad, max_len, min_len):
    b = image_embs.shape[0]
    out = torch.full((b, 1), sot, dtype=torch.long, device=image_embs.device)
    done = torch.zeros(b, dtype=torch.bool, device=out.device)
    while out.shape[1] < max_len:
        lp = next_logprobs(coca, image_embs, out)
        if out.shape[1] < min_len:
            lp[:, eot] = -torch.inf
        tok = lp.argmax(-1)
        if out.shape[1] == max_len - 1:
            tok.fill_(eot)
        tok = torch.where(done, pad, tok)
        out = torch.cat([out, tok[:, None]], 1)
        done |= tok == eot
        if bool(done.all()):  # one host read per step: generation decides its own length
            break
    return out


def _beam(coca, image_embs, sot, eot, pad, max_len, min_len, k, length_penalty):
    b, dev = image_embs.shape[0], image_embs.device
    embs = image_embs.repeat_interleave(k, 0)  # (B*K, Q, W): beam j of image i at row i*K + j
    beams = torch.full((b * k, 1), sot, dtype=torch.long, device=dev)
    scores = torch.full((b, k), -torch.inf, device=dev)
    scores[:, 0] = 0.0  # one live beam at the start (the others would repeat it)
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(b)]
    done = [False] * b
    while not all(done):
        t = beams.shape[1]
        lp = next_logprobs(coca, embs, beams)  # (B*K, V)
        if t < min_len:
            lp[:, eot] = -torch.inf
        if t == max_len - 1:  # the last position: every live beam ends here
            keep = torch.full_like(lp, -torch.inf)
            keep[:, eot] = lp[:, eot]
            lp = keep
        vocab = lp.shape[1]
        cand = (scores.reshape(-1, 1) + lp).reshape(b, k * vocab)
        top, idx = cand.topk(2 * k, dim=1)  # room for k live beams after up to k of them end
        top, idx, rows = top.tolist(), idx.tolist(), beams.tolist()
        new_rows, new_scores = [], []
        for i in range(b):
            live: list[tuple[float, list[int]]] = []
            if not done[i]:
                for s, j in zip(top[i], idx[i]):
                    if s == -float("inf"):
                        break
                    beam, tok = divmod(j, vocab)
                    seq = rows[i * k + beam] + [tok]
                    if tok == eot:
                        finished[i].append((s / len(seq) ** length_penalty, seq))
                        finished[i].sort(key=lambda h: -h[0])
                        del finished[i][k:]
                    else:
                        live.append((s, seq))
                    if len(live) == k:
                        break
                best_live = max((s for s, _ in live), default=-float("inf"))
                done[i] = t + 1 >= max_len or not live or (
                    len(finished[i]) == k and finished[i][-1][0] >= best_live / (t + 1) ** length_penalty)
            if done[i]:
                live = []
            live += [(-float("inf"), rows[i * k][:t] + [pad])] * (k - len(live))  # dead rows, never chosen
            new_rows += [seq for _, seq in live]
            new_scores.append([s for s, _ in live])
        beams = torch.tensor(new_rows, dtype=torch.long, device=dev)
        scores = torch.tensor(new_scores, device=dev)
    best = [max(h, key=lambda x: x[0])[1] for h in finished]
    out = torch.full((b, max(len(s) for s in best)), pad, dtype=torch.long, device=dev)
    for i, seq in enumerate(best):
        out[i, :len(seq)] = torch.tensor(seq, device=dev)
    return out


def decode_captions(ids: torch.Tensor, tokenizer, sot: int, eot: int) -> list[str]:
    """Caption strings of ``generate``'s rows: the ids between ``sot`` and the first ``eot``, decoded by the
    tokenizer (clip_benchmark's captioning task decodes open_clip's output the same way)."""
    out = []
    for row in ids.tolist():
        row = row[1:] if row and row[0] == sot else row
        row = row[:row.index(eot)] if eot in row else row
        out.append(tokenizer.decode(row).strip())
    return out
