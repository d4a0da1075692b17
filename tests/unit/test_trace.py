"""Replay traces (`dcut.trace`): the writer an engine fills, the file format, the pools replay draws from,
and the runner recording one (every draft verified, widths in rotation)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dcut.cost_table import Fingerprint
from dcut.settings import DCutSettings
from dcut.trace import UNKNOWN, Trace, TraceWriter, from_rows
from dcut.vllm.state import RunnerDCut


def test_writer_pairs_each_drafting_pass_with_the_next_verification(tmp_path):
    w = TraceWriter(k=4, meta={"pair": "x"})
    w.step(["a", "b"], [10, 20], 3, np.log(np.full((2, 3), 0.5)), 5.0, 1.0, None)
    # b finished before verification (verified 1 of 3): its accepted length is not the truth.
    w.verified(["a", "b"], [3, 1], [2, 1])
    w.step(["a"], [13], 1, np.log(np.full((1, 1), 0.9)), 4.0, 0.5, 0.3)
    t = w.save(tmp_path / "t.npz")
    assert t.accepted.tolist() == [2, UNKNOWN, UNKNOWN]  # the last pass was never verified
    back = Trace.load(tmp_path / "t.npz")
    assert back.meta == {"pair": "x"} and back.step_width.tolist() == [3, 1]
    assert back.ctx_len.tolist() == [10, 20, 13] and back.step_offsets.tolist() == [0, 2, 3]
    assert math.isnan(back.overhead_ms[0]) and back.overhead_ms[1] == pytest.approx(0.3)
    assert np.isnan(back.log_conf[0, 3]) and back.log_conf[0, 0] == pytest.approx(math.log(0.5), abs=1e-3)
    conf, acc = back.pool(3)
    assert conf.shape == (1, 3) and acc.tolist() == [2]
    assert back.widths() == [3]


def test_concat_keeps_each_steps_rows():
    a = from_rows(2, [{"bs": 1, "width": 2, "log_conf": [[-0.1, -0.2]], "accepted": [1]}])
    b = from_rows(2, [{"bs": 2, "width": 1, "log_conf": [[-0.3], [-0.4]], "accepted": [0, 1]}])
    t = Trace.concat([a, b])
    assert t.step_offsets.tolist() == [0, 1, 3] and t.pool(1)[1].tolist() == [0, 1] and t.pool(2)[1].tolist() == [1]
    with pytest.raises(ValueError):
        Trace.concat([a, from_rows(3, [])])


def test_a_tracing_runner_rotates_widths_verifies_everything_and_records_truth(tmp_path):
    fp = Fingerprint(hardware="cpu", model="m", drafter="d", k=4)
    r = RunnerDCut(DCutSettings(mode="joint", trace=str(tmp_path), trace_widths=[1, 3]), fp, k=4)
    ids = ["a", "b"]
    kept: list[list[int]] = [[], []]
    widths = []
    for step in range(4):
        r.begin_step({q: 1 + len(d) for q, d in zip(ids, kept, strict=True)}, dict(zip(ids, kept, strict=True)))
        w = r.choose_width(2, 4)
        widths.append(w)
        # a accepts everything it verified, b nothing.
        row_a = [0] * (len(kept[0]) + 1) + [-1] * (3 - len(kept[0]))
        sampled = torch.tensor([row_a, [0, -1, -1, -1]]) if step else None
        r.on_drafted(ids, torch.full((2, w), math.log(0.6)), sampled, [len(d) for d in kept] if step else None,
                     [10 + step, 20 + step])
        kept = r.cut(ids, [[7] * w, [8] * w])
        assert [len(d) for d in kept] == [w, w]  # nothing cut while tracing
    assert widths == [1, 3, 1, 3]
    t = Trace.load(r.save_trace())
    assert t.step_width.tolist() == [1, 3, 1, 3] and t.ctx_len.tolist()[:2] == [10, 20]
    assert t.accepted.tolist() == [1, 0, 3, 0, 1, 0, UNKNOWN, UNKNOWN]


def test_trace_widths_are_validated():
    with pytest.raises(ValueError, match="trace_widths"):
        DCutSettings(trace_widths=[0, 3])
