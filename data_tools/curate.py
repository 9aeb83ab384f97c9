"""The filter's rules, each a pure function of per-sample arrays (no I/O): a boolean "keep" mask.

- :func:`score_mask`: keep the top fraction, or those at or above a score (DataComp's CLIP-score filter).
- :func:`semdedup`: SemDeDup (Abbas et al. 2023): spherical k-means (faiss, else scikit-learn, on
  L2-normalised rows, fitted on a sample of at most 100,000), then in each cluster the members are ordered by cosine to their centroid,
  least similar first, and a member is removed when any member before it has cosine above the
  threshold: of a group of near-duplicates the one farthest from the centroid survives.
- :func:`balance_mask`: MetaCLIP's balancing: an entry (subgroup, cluster, or metadata entry matched in
  the caption) with more than ``cap`` samples keeps each with probability ``cap / count``; a sample is kept
  when one of its entries keeps it (a draw seeded by the seed, the sample key and the entry), so the
  result does not depend on the order of shards. Samples matching no entry are removed (MetaCLIP keeps
  only text that matches its metadata).
- :func:`basic_mask`: DataComp's basic filter: image short side >= 200 px, aspect ratio < 3, caption of
  more than 2 words and 5 characters.
- :func:`language_mask`: langid.py (its model ships inside the package) says the caption is ``lang``.
- :func:`near_any`: the highest cosine of each row to any row of another set (decontamination).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter

import numpy as np

CHUNK = 4096  # rows per matrix product in near_any


def unit(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length, as float32 (chunked: float16 rows of millions of samples never exist
    in float64)."""
    out = np.empty(x.shape, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite row stays non-finite (the filter drops it)
        for a in range(0, len(x), 1 << 16):
            c = np.asarray(x[a:a + (1 << 16)], dtype=np.float32)
            out[a:a + len(c)] = c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-12)
    return out


def finite_rows(x: np.ndarray) -> np.ndarray:
    """Which rows hold only finite values (chunked: no n x E boolean array)."""
    out = np.empty(len(x), dtype=bool)
    for a in range(0, len(x), 1 << 16):
        out[a:a + (1 << 16)] = np.isfinite(x[a:a + (1 << 16)]).all(axis=1)
    return out


def cosines(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Row-wise cosine of two row sets (chunked)."""
    out = np.empty(len(x), dtype=np.float32)
    for a in range(0, len(x), 1 << 16):
        out[a:a + (1 << 16)] = np.einsum("ne,ne->n", unit(x[a:a + (1 << 16)]), unit(y[a:a + (1 << 16)]))
    return out


def score_mask(scores: np.ndarray, keep_top: float | None = None, min_score: float | None = None) -> np.ndarray:
    """``keep_top``: the ``round(fraction * n)`` best scores (ties broken by position, earlier first);
    ``min_score``: scores >= it. Both: both must hold. A NaN score is never kept."""
    n = len(scores)
    keep = np.isfinite(scores)
    if keep_top is not None:
        order = np.argsort(-np.where(keep, scores, -np.inf), kind="stable")
        top = np.zeros(n, dtype=bool)
        top[order[:int(round(keep_top * n))]] = True
        keep &= top
    if min_score is not None:
        keep &= scores >= min_score
    return keep


FIT_ROWS = 100_000  # k-means is fitted on at most this many rows (a seeded sample), then every row assigned


def default_clusters(n: int) -> int:
    """sqrt(n): the k that balances the assignment's n*k*d against the within-cluster pairs' n*(n/k)*d."""
    return max(1, round(math.sqrt(n)))


def kmeans(x: np.ndarray, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(labels, unit centroids) of spherical k-means on unit rows ``x``: faiss's ``Kmeans`` (spherical, 20
    iterations, seeded) on a seeded sample of at most :data:`FIT_ROWS` rows (all of them below that), then
    each row to its most similar centroid (chunked). faiss fits 100,000 rows into 1,703 clusters in 29 s
    where scikit-learn's KMeans (k-means++, Lloyd) takes 304 s on the same 2 cores
    (scripts/bench/bench_filter.py); scikit-learn's is the fallback where faiss is not installed."""
    k = max(1, min(k, len(x)))
    rng = np.random.default_rng(seed)
    fit = np.ascontiguousarray(x if len(x) <= FIT_ROWS else x[np.sort(rng.choice(len(x), FIT_ROWS, replace=False))])
    try:
        import faiss
    except ImportError:
        faiss = None
    if faiss is not None:
        km = faiss.Kmeans(fit.shape[1], k, niter=20, seed=seed, spherical=True, verbose=False,
                          min_points_per_centroid=1, max_points_per_centroid=1 << 30)
        km.train(fit)
        centroids = unit(km.centroids)
    else:
        from sklearn.cluster import KMeans

        centroids = unit(KMeans(n_clusters=k, random_state=seed, n_init=1, max_iter=20).fit(fit).cluster_centers_)
    labels = np.empty(len(x), dtype=np.int64)
    for a in range(0, len(x), CHUNK):
        labels[a:a + CHUNK] = (x[a:a + CHUNK] @ centroids.T).argmax(1)
    return labels, centroids


def kmeans_backend() -> str:
    try:
        import faiss
    except ImportError:
        import sklearn

        return f"scikit-learn {sklearn.__version__}"
    return f"faiss {faiss.__version__}"


def semdedup(x: np.ndarray, threshold: float, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(keep mask, cluster labels) of SemDeDup on rows ``x`` (see the module's doc)."""
    x = unit(x)
    labels, centroids = kmeans(x, k, seed)
    keep = np.ones(len(x), dtype=bool)
    order = np.argsort(labels, kind="stable")
    bounds = np.flatnonzero(np.diff(labels[order])) + 1
    for members in np.split(order, bounds):
        if len(members) < 2:
            continue
        to_centroid = x[members] @ centroids[labels[members[0]]]
        members = members[np.argsort(to_centroid, kind="stable")]  # least similar to the centroid first
        xm = x[members]
        sim = np.triu(xm @ xm.T, k=1)  # sim[i, j], i before j
        keep[members[sim.max(axis=0) > threshold]] = False
    return keep, labels


def _draw(seed: int, key: str, entry: str) -> float:
    h = hashlib.blake2b(f"{seed}:{key}:{entry}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0 ** 64


def balance_mask(entries: list[list[str]], keys: list[str], cap: int, seed: int = 0) -> tuple[np.ndarray, Counter]:
    """(keep mask, entry counts) of MetaCLIP's balancing (see the module's doc)."""
    counts = Counter(e for es in entries for e in set(es))
    keep = np.zeros(len(entries), dtype=bool)
    for i, (es, key) in enumerate(zip(entries, keys)):
        keep[i] = any(counts[e] <= cap or _draw(seed, key, e) < cap / counts[e] for e in sorted(set(es)))
    return keep, counts


def match_entries(captions: list[str], entries: list[str]) -> list[list[str]]:
    """Each caption's metadata entries: MetaCLIP's substring matching, at word boundaries (so that "cat"
    does not match "category") and case-folded; every word n-gram of the caption up to the longest
    entry is looked up in a set (linear in the caption, whatever the number of entries)."""
    norm = {" ".join(re.findall(r"\w+", e.lower())) for e in entries}
    norm.discard("")
    longest = max((e.count(" ") + 1 for e in norm), default=0)
    out = []
    for c in captions:
        words = re.findall(r"\w+", c.lower())
        found = {" ".join(words[i:i + n]) for n in range(1, longest + 1) for i in range(len(words) - n + 1)}
        out.append(sorted(found & norm))
    return out


def basic_mask(widths: np.ndarray, heights: np.ndarray, captions: list[str], min_side: int = 200,
               max_aspect: float = 3.0, min_words: int = 3, min_chars: int = 6) -> np.ndarray:
    """DataComp's basic filter (its language rule is :func:`language_mask`). Unknown sizes (-1) fail."""
    w, h = np.asarray(widths), np.asarray(heights)
    ok = (np.minimum(w, h) >= min_side) & (np.maximum(w, h) < max_aspect * np.maximum(np.minimum(w, h), 1))
    words = np.array([len(c.split()) >= min_words and len(c.strip()) >= min_chars for c in captions], dtype=bool)
    return ok & words


def language_mask(captions: list[str], lang: str = "en") -> np.ndarray:
    import langid

    return np.array([bool(c.strip()) and langid.classify(c)[0] == lang for c in captions], dtype=bool)


def near_any(x: np.ndarray, others: np.ndarray) -> np.ndarray:
    """For each row of ``x``, the highest cosine to any row of ``others`` (chunked)."""
    x, others = unit(x), unit(others)
    best = np.full(len(x), -1.0, dtype=np.float32)
    for a in range(0, len(x), CHUNK):
        for b in range(0, len(others), CHUNK):
            best[a:a + CHUNK] = np.maximum(best[a:a + CHUNK], (x[a:a + CHUNK] @ others[b:b + CHUNK].T).max(axis=1))
    return best


def uid_strings(array: np.ndarray) -> set[str]:
    """DataComp's UID list (``np.load`` of its .npy): 128-bit uids as a structured ``u8,u8`` array or an
    (n, 2) uint64 array (high, low), or hex strings; as 32-digit lower-case hex strings."""
    if array.dtype.names and len(array.dtype.names) == 2:
        hi, lo = (array[n].astype(np.uint64) for n in array.dtype.names)
    elif array.ndim == 2 and array.shape[1] == 2 and array.dtype.kind in "ui":
        hi, lo = array[:, 0].astype(np.uint64), array[:, 1].astype(np.uint64)
    elif array.dtype.kind in "US":
        return {(s.decode() if isinstance(s, bytes) else str(s)).lower() for s in array.ravel()}
    else:
        raise ValueError(f"a UID list is a structured u8,u8 array, an (n, 2) integer array or strings, not "
                         f"{array.dtype} of shape {array.shape}")
    return {f"{int(a):016x}{int(b):016x}" for a, b in zip(hi, lo)}
