"""Honest clocks (issue 61, item 2): ``RunnerDCut`` times what the device did, not what the host launched.

A simulated engine drives the runner as vLLM's hooks do, on a device that is either synchronous (a launch returns
when its work is done: the CPU) or asynchronous (a launch returns at once and the work finishes later: a GPU). With
the device's marks (``dcut.vllm.step_clock``) both record the same step times and make the same decisions; host
timers on the asynchronous device measure launches, and the cost table they refine drifts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dcut.cost_table import CostTable, Fingerprint
from dcut.settings import DCutSettings
from dcut.vllm.state import RunnerDCut
from dcut.vllm.step_clock import EventTimer, HostTimer, timer_for

FP = Fingerprint(hardware="sim", model="m", drafter="d", k=4)
REQS = ["a", "b"]


class Device:
    """A simulated accelerator beside its host (times in seconds)."""

    def __init__(self, asynchronous: bool) -> None:
        self.asynchronous = asynchronous
        self.host = self.free = 1.0  # the host's clock; when the device has done all it was given

    def clock(self) -> float:
        return self.host

    def launch(self, ms: float) -> None:
        """Enqueue ``ms`` of work: it starts when the device is free and the launch is made."""
        self.free = max(self.free, self.host) + ms / 1000.0
        if not self.asynchronous:
            self.host = self.free

    def wait(self) -> None:
        """The host waits for everything launched (vLLM's wait for the draft tokens' copy)."""
        self.host = max(self.host, self.free)


class DeviceTimer:
    """Device events: a mark is reached once the device has done what was launched before it; reading one the host
    has not waited for is an error (on a GPU, a read there would wait: a sync of D-Cut's own)."""

    def __init__(self, device: Device) -> None:
        self.device = device

    def mark(self) -> float:
        return max(self.device.free, self.device.host)

    def ms(self, start: float, end: float) -> float:
        assert end <= self.device.host, "a device time read before the engine waited for it"
        return (end - start) * 1000.0


def _verify_ms(tokens: int) -> float:
    return 6.0 + 0.8 * tokens  # what the device takes (the table below says otherwise: refinement must learn it)


def _draft_ms(width: int) -> float:
    return 0.3 + 0.9 * width


def _run(device: Device, timer: Any, steps: int = 96) -> tuple[list[tuple], RunnerDCut]:
    """An engine's steps (``dcut.vllm.step_hooks``'s order, vLLM's waits): the widths drafted and the drafts kept,
    and the runner."""
    r = RunnerDCut(DCutSettings(mode="joint", calibrate=False, widths=[0, 2, 4], probe_share=0.0), FP, k=4,
                   clock=device.clock, timer=timer)
    r.cost_table = CostTable(FP, {2: [(2, 9.0, 3), (6, 10.0, 3), (10, 11.0, 3)]},
                             draft={2: {0: (0.2, 1), 2: (1.0, 1), 4: (1.5, 1)}})
    spec: dict[str, list[int]] = {}
    decisions = []
    for step in range(steps):
        r.begin_step({q: 1 + len(spec.get(q, ())) for q in REQS}, spec)
        device.launch(_verify_ms(len(REQS) + sum(map(len, spec.values()))))  # the target's forward: async on a GPU
        width = r.choose_width(len(REQS), 4, REQS)
        if step % 9 == 4:  # a catch-up flush before drafting (dcut.vllm.catch_up)
            start = r.mark()
            device.launch(1.5)
            r.on_flush(start, rows=4)
        device.launch(_draft_ms(width))
        generator = torch.Generator().manual_seed(step)
        log_conf = torch.log(torch.rand(len(REQS), width, generator=generator)) if width else None
        sampled = num_draft = None
        if any(spec.values()):  # what verification accepted of last step's drafts
            num_draft = [len(spec[q]) for q in REQS]
            accepted = [min(n, (step + i) % 3) for i, n in enumerate(num_draft)]
            sampled = torch.tensor([[7] * (a + 1) + [-1] * (4 - a) for a in accepted])
        r.on_drafted(REQS, log_conf, sampled, num_draft)
        device.wait()  # take_draft_token_ids: vLLM waits for the drafts' copy to the host
        drafts = r.cut(REQS, [[1, 2, 3, 4][:width], [5, 6, 7, 8][:width]])
        decisions.append((width, [len(d) for d in drafts]))
        spec = dict(zip(REQS, drafts, strict=True))
        device.host += 0.002  # the engine's own work between steps (scheduling, outputs): host only
    r.settle()
    return decisions, r


def _recorded(r: RunnerDCut) -> dict[str, Any]:
    """What the runner measured and learned from its clocks."""
    return {
        "steps": [(s.verify_ms, s.draft_ms, s.step_ms, s.width, s.kept) for s in r.window.records],
        "table": r.cost_table.to_json() if r.cost_table is not None else None,
        "realized": r.realized.summary(),
        "overhead": (r.overhead.per_step_ms, r.overhead.per_token_ms),
    }


def test_an_asynchronous_device_records_and_decides_as_a_synchronous_one() -> None:
    sync = Device(asynchronous=False)
    decided, runner = _run(sync, HostTimer(sync.clock))
    device = Device(asynchronous=True)
    decided_async, runner_async = _run(device, DeviceTimer(device))
    assert decided_async == decided
    assert _recorded(runner_async) == _recorded(runner)
    assert len({w for w, _ in decided}) > 1  # the widths rest on what the clocks measured
    steps = _recorded(runner)["steps"]
    assert steps[5][:2] == pytest.approx((_verify_ms(2 + sum(decided[4][1])), _draft_ms(decided[5][0])))


def test_host_timers_around_asynchronous_work_measure_launches() -> None:
    """The check above has the power to see the old way: the host clock on the asynchronous device records a
    target's part of 0 ms, and the cost table refined on it drifts down."""
    device = Device(asynchronous=True)
    decided_host, runner_host = _run(device, HostTimer(device.clock))
    sync = Device(asynchronous=False)
    decided, runner = _run(sync, HostTimer(sync.clock))
    assert all(s.verify_ms == 0.0 for s in runner_host.window.records)
    assert runner_host.cost_table.draft_cost(2, 2) < 0.1 < 2.0 < runner.cost_table.draft_cost(2, 2)
    assert decided_host != decided


def test_a_cpu_runner_times_on_the_host_a_cuda_one_by_events() -> None:
    assert isinstance(timer_for(torch.device("cpu")), HostTimer)
    assert isinstance(timer_for(torch.device("cuda")), EventTimer)  # (built without touching a GPU)
    timer = HostTimer(lambda: 2.5)
    assert timer.ms(timer.mark(), 3.0) == pytest.approx(500.0)
