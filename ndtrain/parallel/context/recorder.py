"""What the context-parallel attention did and when, for `ndtrain trace`: each ring step's
compute (forward "attn F", backward "attn B"), each message from its post to the end of its
wait (kind "kv", "dkv"; all-gather and all-to-all back ends: "kv", "qkv", "out", which block,
so they are all wait), and each wait ("wait kv", ...). Events carry the layer as `chunk` and
the ring step as `micro` (parallel/pipeline/timeline.Event)."""

from __future__ import annotations

from ndtrain.parallel.pipeline.timeline import Event, Timeline

COMPUTE = ("attn F", "attn B")


class RingTimeline(Timeline):
    def compute(self, kind: str, layer: str, step: int, start: float) -> None:
        self.events.append(Event(kind, _layer(layer), step, start, self.now()))

    def message(self, kind: str, layer: str, step: int, posted: float, wait_start: float) -> None:
        end = self.now()
        self.events.append(Event(kind, _layer(layer), step, posted, end))
        self.events.append(Event(f"wait {kind}", _layer(layer), step, wait_start, end))


def _layer(key: str) -> int:
    return int(key) if key.isdigit() else -1


def overlap(events: list[Event]) -> dict[str, float]:
    """One rank's totals (seconds): attention compute, messages in flight (post to arrival),
    time spent waiting for them, and the share of in-flight time hidden behind compute."""
    compute = sum(e.end - e.start for e in events if e.kind in COMPUTE)
    waits = [e for e in events if e.kind.startswith("wait ")]
    flight = sum(e.end - e.start for e in events if e.kind not in COMPUTE and not e.kind.startswith("wait "))
    waited = sum(e.end - e.start for e in waits)
    return {"compute": compute, "in_flight": flight, "waited": waited, "messages": len(waits),
            "hidden": 1.0 - waited / flight if flight > 0 else 0.0}
