"""docs/rl-timeline.png: who waits for what in a step of RL, synchronous and asynchronous,
drawn from the times every rank recorded in a real run (RL.timeline), not invented.

The two jobs of `ndtrain bench rl` (its defaults: the tiny model from random weights, 48
completions of up to 32 new tokens per update, a tenth of the prompts allowed the whole
length and the others an eighth of it): synchronous on 3 ranks (each samples its share, waits
for the others' in the gather, computes the old log-probabilities and trains), asynchronous
on 2 training ranks and 1 generator at staleness 1 (rank 0 sends the weights, the ranks wait
for the rollout, then train while the generator samples the next). One run of each, updates
1 to 5 (update 0 carries the start-up), on one time axis.
PYTHONPATH=. python docs/rl_timeline_plot.py docs/rl-timeline.png"""

import sys

STEPS = 7  # updates run; the picture shows 1 .. STEPS - 2 (each bar ends where the next update begins)
COLORS = {"generate": "#4c72b0", "wait": "#c0c0c0", "train": "#55a868", "send": "#c44e52"}


def jobs() -> dict:
    """{side: every rank's result} of one run of each side of bench rl."""
    from ndtrain.bench.rl import BENCH, SIDES, _template, _worker
    from ndtrain.config import load_config, validate
    from ndtrain.launch import launch_local
    from ndtrain.train.rl import job

    out = {}
    for side, keys in SIDES.items():
        world = 3 if side == "sync" else 2
        cfg = validate(load_config(None, list(BENCH.model + BENCH.settings) + keys + [
            f"train.steps={STEPS}", "run.threads=1", "run.device=cpu"]), world=world)
        cfg.train.seq_len = job.row_length(cfg)
        out[side] = launch_local(world, _worker, cfg.to_dict(), _template())
    return out


def bars(side: str, ranks: list[dict]) -> dict[str, list[tuple[str, float, float]]]:
    """{row label: [(kind, start, end)]} in absolute seconds, updates 1 .. STEPS - 2."""
    rows = {}
    for r, rank in enumerate(ranks):
        tl, mine = rank["timeline"], []
        for a, b in zip(tl[1:], tl[2:]):
            if side == "sync":
                mine += [("generate", a["begin"], a["sampled"]), ("wait", a["sampled"], a["end"]),
                         ("train", a["end"], b["begin"])]
            else:
                mine += [("send", a["begin"], a["pushed"]), ("wait", a["pushed"], a["received"]),
                         ("train", a["received"], b["begin"])]
        rows[f"rank {r}"] = mine
        if side == "async" and r == 0:  # the rollouts it sampled while update 1 and later ran (its first ones earlier)
            start, gen = tl[1]["begin"], []
            for a in tl[1:]:
                began, ready, done = a["generator"]
                gen += [(kind, max(s, start), e) for kind, s, e in (("wait", began, ready), ("generate", ready, done))
                        if e > start]
            rows["generator"] = gen
    return rows


def main(out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    runs = jobs()
    panels = {side: bars(side, ranks) for side, ranks in runs.items()}
    spans = {side: max(e for row in p.values() for _, _, e in row) - min(s for row in p.values() for _, s, _ in row)
             for side, p in panels.items()}  # from update 1's start to the last update's end (or the last sample's)
    fig, axes = plt.subplots(2, 1, figsize=(11, 4.6), sharex=True)
    titles = {"sync": "synchronous: 3 ranks generate their shares, then all train",
              "async": "asynchronous: 2 training ranks, 1 generator, staleness 1"}
    for ax, (side, rows) in zip(axes, panels.items()):
        t0 = min(s for label, row in rows.items() if label.startswith("rank") for _, s, _ in row)
        labels = list(rows)
        for y, label in enumerate(labels):
            for kind, s, e in rows[label]:
                ax.barh(y, e - s, left=s - t0, height=0.6, color=COLORS[kind], edgecolor="white", linewidth=0.3)
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.set_title(f"{titles[side]}: {STEPS - 2} updates in {spans[side]:.1f} s", fontsize=10, loc="left")
    axes[-1].set_xlabel("seconds (wall clock, from each run's update 1)")
    fig.legend(handles=[Patch(color=c, label={"generate": "sample", "wait": "wait (for the other shares, the "
                                              "rollout, or the weights)", "train": "train (old log-probs + update)",
                                              "send": "gather and send the weights"}[k]) for k, c in COLORS.items()],
               loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out, dpi=120)
    print(f"{out}: sync {spans['sync']:.2f} s, async {spans['async']:.2f} s for updates 1..{STEPS - 2}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/rl-timeline.png")
