"""Weighted mixtures (data/mixture.py): each source's share of the trained tokens follows its
weight; rows come from the source the plan names; a source that runs out repeats in a new
order or stops the run; the command line carries source_tokens and val_loss.<name>; bad
sources get one line and exit 2 with nothing written. Elastic resume: tests/test_mixture_resume.py."""

import json
from pathlib import Path

import numpy as np
import pytest

from mixture_helpers import mixture_sources, prepared_mixture, sources_override, texts, write_txt_folder
from ndtrain.data.mixture import MixtureLoader, MixturePlan, apportion
from ndtrain.data.shards import DataError

SEQ = 32


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    sources = mixture_sources(root)
    return root, sources, prepared_mixture(root, sources)


def test_apportioned_counts_stay_within_two_rows_of_their_targets():
    """For random weights (down to 1e-4 of the total), sources and batch sizes, after every
    step each source's row count is within 2 rows of weight × rows so far: a share within
    2/N of the weight after N rows (0.25% after 100 steps of 8 rows)."""
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(100):
        s, g = int(rng.integers(1, 10)), int(rng.integers(1, 33))
        w = rng.random(s) ** 4 + 1e-4
        plan = MixturePlan(w, g, seed=0)
        counts = np.zeros(s, dtype=np.int64)
        for step in range(120):
            q = np.asarray(apportion(plan.weights * ((step + 1) * g) - counts, g))
            assert q.min() >= 0 and q.sum() == g
            counts += q
            worst = max(worst, float(np.abs(counts - plan.weights * (step + 1) * g).max()))
        assert np.array_equal(plan.counts(120), counts)
    assert worst < 2, worst


def test_plan_is_a_pure_function_of_the_step():
    a = MixturePlan([7, 2, 1], 12, seed=3)
    b = MixturePlan([0.7, 0.2, 0.1], 12, seed=3)  # weights are relative
    late = a.counts(5000)  # past an anchor; then back to early steps
    assert np.array_equal(late, MixturePlan([7, 2, 1], 12, seed=3).counts(5000))
    for step in (0, 1, 17, 4097):
        src_a, idx_a = a.samples(step, 0, 12)
        src_b, idx_b = b.samples(step, 0, 12)
        assert np.array_equal(src_a, src_b) and np.array_equal(idx_a, idx_b)
        parts = [a.samples(step, lo, lo + 3) for lo in range(0, 12, 3)]  # any cut into rank shares
        assert np.array_equal(np.concatenate([p[0] for p in parts]), src_a)
        assert np.array_equal(np.concatenate([p[1] for p in parts]), idx_a)
    assert not np.array_equal(a.step_sources(5), MixturePlan([7, 2, 1], 12, seed=4).step_sources(5))


def _windows(stream, seq):
    n = (len(stream) - 1) // seq
    return {tuple(stream.slice(w * seq, w * seq + seq + 1).tolist()): w for w in range(n)}


def test_acceptance_shares_after_100_steps_and_rows_from_the_named_source(mix):
    """A parquet folder, a .jsonl.zst file and a .txt folder at 0.5/0.3/0.2: after 100 steps of
    8 rows, each source's share of the tokens is within 0.01 of its weight, counted from the
    rows themselves (each found among the windows of exactly the source the plan names)."""
    _, sources, data = mix
    streams = [s.data.stream("train") for s in data.sources]
    loader = MixtureLoader(streams, [s.weight for s in data.sources], SEQ, 8, seed=0,
                           names=[s.name for s in data.sources])
    windows = [_windows(st, SEQ) for st in streams]
    found = np.zeros(3, dtype=np.int64)
    seen = [set() for _ in streams]
    for step in range(100):
        x, y = loader.rows(step, 0, 8)
        assert torch_equal_shifted(x, y)
        for row in np.concatenate([x.numpy(), y.numpy()[:, -1:]], axis=1):
            owners = [j for j, w in enumerate(windows) if tuple(row.tolist()) in w]
            assert len(owners) == 1, owners
            j = owners[0]
            w = windows[j][tuple(row.tolist())]
            assert w not in seen[j]  # within one pass, no window twice
            seen[j].add(w)
            found[j] += 1
    shares = found / found.sum()
    assert np.abs(shares - [0.5, 0.3, 0.2]).max() <= 0.01, shares
    tokens = loader.source_tokens(100)
    assert list(tokens.values()) == [int(n) * SEQ for n in found]


def torch_equal_shifted(x, y):
    return bool((x[:, 1:] == y[:, :-1]).all())


def test_a_source_that_runs_out_repeats_in_a_new_order_or_stops(tmp_path, mix):
    root, sources, data = mix
    streams = [s.data.stream("train") for s in data.sources]
    small = streams[2]
    windows = (len(small) - 1) // SEQ
    # weight of `notes` high enough to pass its windows within the run
    loader = MixtureLoader(streams, [0.1, 0.1, 0.8], SEQ, 16, seed=0, names=["web", "code", "notes"])
    steps = -(-2 * windows // 13) + 1
    (line,) = loader.passes(steps, [True, True, True])
    assert line.startswith("data source 'notes' repeats:") and "passes), each pass in a new order" in line
    with pytest.raises(DataError, match=r"data source 'notes' runs out: its \d+ windows .* repeat = false"):
        loader.passes(steps, [True, True, False])
    order = [loader.sources[2].window_of(i) for i in range(2 * windows)]
    assert sorted(order[:windows]) == sorted(order[windows:]) == list(range(windows))
    assert order[:windows] != order[windows:]


def _train(root, sources, extra, capsys=None):
    from ndtrain.cli import main
    return main(["train", "--nproc", "1", "run.max_restarts=0", sources_override(sources), "data.vocab_size=400", "data.val_fraction=0.2",
                 f"data.cache_dir={root / 'cache'}", "model.preset=tiny", "train.global_batch=8",
                 f"train.seq_len={SEQ}", "train.eval_batches=1", "run.device=cpu", "run.progress=false",
                 "run.plot=false"] + extra)


def test_train_records_source_tokens_and_val_loss_per_source(mix, capsys):
    root, sources, _ = mix
    run = root / "run"
    assert _train(root, sources, ["train.steps=4", "train.eval_every=2", f"run.dir={run}"]) == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # 32 rows: 0.5, 0.3 and 0.2 of them to within a row
    assert records[-1]["source_tokens"] == {"web": 16 * SEQ, "code": 10 * SEQ, "notes": 6 * SEQ}
    for r in records:
        assert sum(r["source_tokens"].values()) == r["tokens"]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [1, 3]
    for r in evals:
        per = [r[f"val_loss.{n}"] for n in ("web", "code", "notes")]
        assert r["val_loss"] == pytest.approx(0.5 * per[0] + 0.3 * per[1] + 0.2 * per[2], rel=1e-12)
    last = evals[-1]
    for name, share in (("web", 50.0), ("code", 31.2), ("notes", 18.8)):
        assert f"source {name}: {records[-1]['source_tokens'][name]:,} tokens ({share:.1f}%) · validation loss " \
               f"{last[f'val_loss.{name}']:.4f}" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["source_tokens"] == records[-1]["source_tokens"]
    from ndtrain.cli import main  # `ndtrain prepare` names each source's directory (cached now)
    assert main(["prepare", sources_override(sources), "data.vocab_size=400", "data.val_fraction=0.2",
                 f"data.cache_dir={root / 'cache'}", "run.progress=false"]) == 0
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("prepared")] == \
        ["prepared source web", "prepared source code", "prepared source notes"]
    # a resume keeps its sources
    changed = [dict(s, weight=0.1) if s["name"] == "web" else s for s in sources]
    assert _train(root, changed, ["train.steps=6", f"run.dir={run}"]) == 2
    assert "data.sources = " in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    (lambda s: s[0].update(path=s[0]["path"] + "-missing"), r"data.sources\[0\].path = '.*-missing': path does not exist"),
    (lambda s: s[0].update(text_key="body"), "data source 'web': .*no column 'body'"),
    (lambda s: s[1].update(weight=0), r"data.sources\[1\].weight = 0.0: must be a finite number > 0"),
    (lambda s: s[2].update(weight=-0.5), r"data.sources\[2\].weight = -0.5: must be a finite number > 0"),
    (lambda s: s[1].update(name="web"), r"data.sources\[1\].name = 'web': another source has this name"),
    (lambda s: s[2].update(colour="red"), r"data.sources\[2\].colour = 'red': unknown key"),
], ids=["missing file", "unknown column", "weight 0", "weight < 0", "same name", "unknown key"])
def test_bad_sources_one_line_exit_2_nothing_written(tmp_path, change, message, capsys):
    import re
    sources = mixture_sources(tmp_path)
    change(sources)
    run = tmp_path / "run"
    assert _train(tmp_path, sources, ["train.steps=2", f"run.dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err
    assert not run.exists() and not (tmp_path / "cache").exists()


def test_data_path_and_sources_together_are_refused(tmp_path, capsys):
    from ndtrain.cli import main
    folder = write_txt_folder(tmp_path / "t", texts(3))
    assert main(["train", f"data.path={folder}", sources_override([{"path": str(folder)}]), "run.device=cpu",
                 f"run.dir={tmp_path / 'run'}"]) == 2
    assert f"data.path = '{folder}': give data.path or [[data.sources]], not both" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_sources_in_a_toml_file(tmp_path):
    from ndtrain.config import load_config, to_toml, validate
    toml = tmp_path / "mix.toml"
    toml.write_text('[[data.sources]]\nname = "web"\npath = "fineweb/"\nweight = 0.7\n'
                    '[[data.sources]]\npath = "code.jsonl.zst"\ntext_key = "content"\nweight = 0.3\n'
                    'repeat = false\n')
    cfg = load_config(toml)
    assert cfg.data.sources == [
        {"name": "web", "path": "fineweb/", "weight": 0.7, "text_key": "", "repeat": True},
        {"name": "code", "path": "code.jsonl.zst", "weight": 0.3, "text_key": "content", "repeat": False}]
    (tmp_path / "again.toml").write_text(to_toml(cfg))  # a run's config.toml reads back the same
    again = load_config(tmp_path / "again.toml")  # with path = "stdlib" written out too
    assert again.data.sources == cfg.data.sources
    validate(again, check_paths=False)
    assert Path(tmp_path / "again.toml").read_text().count("sources = [{") == 1


def test_ranks_asking_for_a_mixture_tokenizer_at_once_train_it_once(tmp_path, monkeypatch):
    """Under torchrun every rank prepares before the process group exists: a rank that finds
    another training the mixture's tokenizer waits on its lock and then takes the file it
    wrote, rather than training its own copy. Here the test holds the lock, lets a second
    caller reach it, writes the tokenizer, and releases: the caller trains nothing."""
    import contextlib
    import fcntl
    import threading

    from ndtrain.data import mix_prepare
    from ndtrain.data.mix_prepare import SourceSpec

    trained = []
    monkeypatch.setattr(mix_prepare, "_train_into", lambda final, *a: (trained.append(final), final.write_text("{}")))
    folder = tmp_path / "a"
    write_txt_folder(folder, texts(3, 40))
    specs = [SourceSpec("a", str(folder), 1.0, "text", True)]
    args = (specs, 300, 0.1, tmp_path / "cache", False, False)
    final = Path(mix_prepare._train_tokenizer(*args))
    assert trained == [final]
    final.unlink()
    entered, real_lock = threading.Event(), mix_prepare._build_lock

    @contextlib.contextmanager
    def watched(path, progress):
        entered.set()
        with real_lock(path, progress):
            yield

    monkeypatch.setattr(mix_prepare, "_build_lock", watched)
    with open(mix_prepare._lock_path(final), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        caller = threading.Thread(target=mix_prepare._train_tokenizer, args=args)
        caller.start()
        assert entered.wait(30), "the second caller never asked for the lock"
        final.write_text("{}")
        fcntl.flock(held, fcntl.LOCK_UN)
    caller.join(30)
    assert not caller.is_alive() and trained == [final]  # the first training only
