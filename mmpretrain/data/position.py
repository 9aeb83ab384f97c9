"""Where a rank's stream is (:class:`StreamPosition`): batches consumed and each reader's cursor; JSON,
saved with every checkpoint and refused for a different plan."""

from __future__ import annotations

from typing import Any

from mmpretrain.data.batch import Batch
from mmpretrain.data.plan import StreamPlan


class StreamPosition:
    """The rank's position: batches consumed and each reader's cursor after its last consumed batch."""

    def __init__(self, plan: StreamPlan, state: dict[str, Any] | None = None):
        self.plan = plan
        self.batches = 0
        self.cursors: dict[int, list[int]] = {w: [0, 0, 0, 0] for w in range(plan.workers)}
        if state is not None:
            self.load(state)

    def advance(self, batch: Batch) -> None:
        self.batches += 1
        self.cursors[batch.worker] = list(batch.cursor)

    def state(self) -> dict[str, Any]:
        return {"plan": self.plan.identity(), "batches": self.batches,
                "cursors": {str(w): c for w, c in self.cursors.items()}}

    def load(self, state: dict[str, Any]) -> None:
        mine, theirs = self.plan.identity(), state.get("plan", {})
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            what = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(f"cannot resume the data stream exactly: {what}. Resume with the saved settings, "
                             "or start a new run from the checkpoint's weights (model.pretrained=CHECKPOINT)")
        self.batches = int(state["batches"])
        self.cursors = {int(w): list(c) for w, c in state["cursors"].items()}

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to (a reader that finished epoch e is at e + 1)."""
        return min(c[0] + int(c[3] >= self.plan.reader_length(c[0], w)) for w, c in self.cursors.items())
