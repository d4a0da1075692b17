"""`dcut replay`, `dcut trace` and `dcut compare` refuse bad input with a message and exit status 2."""

from __future__ import annotations

import json

import pytest

from dcut.cli import main


@pytest.mark.parametrize("argv, message", [
    (["replay", "--trace", "nowhere.npz"], "--trace and --costs go together"),
    (["replay", "--trace", "nowhere.npz", "--costs", "nowhere.json"], "nowhere"),
    (["replay", "--steps", "0"], "--steps"),
    (["replay", "--starts", "0"], "--starts"),
    (["replay", "--context", "500"], "--context"),
    (["replay", "--drift", "1.5"], "--drift takes FACTOR:STEPS"),
    (["replay", "--drift", "0:100"], "--drift takes FACTOR:STEPS"),
    (["replay", "--drift", "fast:slow"], "--drift takes FACTOR:STEPS"),
    (["replay", "--jitter", "-0.1"], "--jitter takes a spread"),
    (["trace", "--out", "x", "--trace-widths", "0,3"], ">= 1"),
    (["trace", "--out", "x", "--trace-widths", "3,31"], "<= K"),
    (["compare", "--out", "x", "--modes", "none,fastest"], "unknown modes"),
    (["compare", "--out", "x", "--modes", "none,dynamic"], "--dynamic-schedule"),
    (["compare", "--out", "x", "--modes", "none,joint", "--repeats", "1"], "--repeats"),
    (["compare", "--out", "x", "--modes", "none,none"], "MODE#2"),
    (["compare", "--out", "x", "--modes", "none,fastest#2"], "unknown modes"),
])
def test_bad_input_is_refused(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_custom_case_replays_and_writes_the_report(tmp_path, capsys):
    data = "tests/data/replay"
    assert main(["replay", "--trace", f"{data}/deep-small.npz", "--costs", f"{data}/deep-small-costs.json",
                 "--bs", "4", "--steps", "10", "--warmup", "2", "--starts", "3", "--out", str(tmp_path),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["policy"]: r for r in report["cases"]["deep-small"]["rows"]}
    assert set(rows) >= {"none", "joint", "oracle", "dynamic", "vllm-adaptive"}
    assert report["starts"] == 3 and all(len(r["by_start"]) == 3 and sum(r["widths"].values()) == 30
        for r in rows.values())
    assert len(rows["joint"]["converged_at_step"]) == 3
    k = rows["dynamic"]["k"]  # the best fixed width, each start's rate its own
    assert rows["dynamic"]["by_start"] == rows[f"fixed-{k}" if k else "none"]["by_start"]
    pinned = {p: r for p, r in rows.items() if p.startswith("joint-w")}  # joint pinned at each traced width
    assert pinned and all(set(r["widths"]) == {p[len("joint-w"):]} for p, r in pinned.items())
    md = (tmp_path / "replay.md").read_text()
    assert "from each of 3 starts" in md and "joint / best baseline (per start)" in md
    assert "| joint-w3 / fixed-3 |" in md and "joint / best pinned" in md
    assert (tmp_path / "deep-small.png").exists()


def test_a_drifting_case_is_slower_and_says_so(tmp_path, capsys):
    data = "tests/data/replay"
    argv = ["replay", "--trace", f"{data}/deep-small.npz", "--costs", f"{data}/deep-small-costs.json", "--bs", "4",
            "--steps", "20", "--warmup", "0", "--json"]
    figures = []
    cases = []
    for extra, out in (([], "steady"), (["--drift", "2:10"], "drift"), (["--jitter", "0.2"], "jitter")):
        assert main([*argv, *extra, "--out", str(tmp_path / out)]) == 0
        cases.append(json.loads(capsys.readouterr().out)["cases"]["deep-small"])
        figures.append({r["policy"]: r for r in cases[-1]["rows"]})
    assert cases[1]["drift"] == {"factor": 2.0, "period": 10, "jitter": 0.0, "seed": 0}
    assert figures[1]["none"]["step_ms"] == pytest.approx(1.5 * figures[0]["none"]["step_ms"], rel=1e-3)
    assert "2x on alternate stretches of 10 steps" in (tmp_path / "drift" / "replay.md").read_text()
    assert cases[2]["drift"]["jitter"] == 0.2 and "drift" not in cases[0]
    assert figures[2]["none"]["step_ms"] != pytest.approx(figures[0]["none"]["step_ms"], rel=1e-3)
    assert "lognormal of spread 0.2" in (tmp_path / "jitter" / "replay.md").read_text()
