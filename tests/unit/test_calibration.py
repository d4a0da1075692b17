"""The calibrator learns per-position acceptance and lowers calibration error."""

from __future__ import annotations

import math

import pytest
import torch

from dcut.calibration import Calibrator


def reference_prob(cal: Calibrator, log_conf: torch.Tensor) -> torch.Tensor:
    """The calibration written out on the host (what ``Calibrator``'s lookup table must equal): the bin's rate,
    smoothed towards raw scaled by its position's ratio; a thin bin takes the scaled raw value. At most 1."""
    raw = log_conf.exp().nan_to_num(nan=0.0).clamp(0.0, 1.0)
    positions = torch.arange(log_conf.shape[-1])
    cell = positions * cal.bins + (raw * cal.bins).long().clamp(0, cal.bins - 1)
    count, accepted, raw_sum = (torch.from_numpy(t) for t in cal._rows())
    centre = raw * torch.from_numpy(cal._scales(count.numpy(), accepted.numpy(), raw_sum.numpy()))[positions]
    n, a = count.reshape(-1)[cell], accepted.reshape(-1)[cell]
    smoothed = (a + cal.prior * centre) / (n + cal.prior).clamp_min(1e-12)
    return torch.where(n >= max(cal.min_count, 1), smoothed, centre).clamp(max=1.0)


def calibrate(cal: Calibrator, log_conf: torch.Tensor) -> torch.Tensor:
    """``cal.calibrate`` (host numpy) on a tensor."""
    return torch.from_numpy(cal.calibrate(log_conf.numpy()))


def simulate(cal: Calibrator, steps: int, gen: torch.Generator, n: int = 64, k: int = 6) -> None:
    """Over-confident drafter: raw = true ** 0.4, and worse at late positions."""
    for _ in range(steps):
        true = torch.rand(n, k, generator=gen) * 0.9
        raw = true.pow(0.4 / (1 + 0.2 * torch.arange(k)))
        accepted_draft = torch.rand(n, k, generator=gen) < true
        accepted = accepted_draft.long().cumprod(1).sum(1)  # first rejection ends the prefix
        proposed = torch.randint(1, k + 1, (n,), generator=gen)
        cal.update(raw.log(), proposed, torch.minimum(accepted, proposed))


def test_observation_rule() -> None:
    cal = Calibrator(k=4, bins=2, min_count=0)
    lc = torch.full((2, 4), math.log(0.9))
    # request 0: proposed 3, accepted 1 -> t=0 accepted, t=1 rejected, t=2,3 unseen
    # request 1: proposed 2, accepted 2 -> t=0,1 accepted, t=2 not proposed
    cal.update(lc, torch.tensor([3, 2]), torch.tensor([1, 2]))
    assert cal.count.sum(1).tolist() == [2, 2, 0, 0]
    assert cal.accepted.sum(1).tolist() == [2, 1, 0, 0]
    rel = cal.reliability()
    assert rel["observations"] == [2, 2, 0, 0]
    assert rel["acceptance_rate"] == [1.0, 0.5, None, None]


def test_calibration_reduces_ece() -> None:
    gen = torch.Generator().manual_seed(0)
    cal = Calibrator(k=6)
    simulate(cal, 60, gen)
    rel = cal.reliability()
    checked = 0
    for n, raw, calibrated in zip(rel["observations"], rel["ece_raw"], rel["ece_calibrated"], strict=True):
        if n >= 150:  # late positions are rarely reached: too few outcomes to judge
            assert calibrated < raw * 0.7
            checked += 1
    assert checked >= 3
    # calibrated values move toward the truth: raw 0.9 at position 0 is really about 0.9 ** 2.5
    out = calibrate(cal, torch.full((1, 6), math.log(0.9)))
    assert out.shape == (1, 6) and float(out[0, 0].exp()) == pytest.approx(0.9**2.5, abs=0.1)


def test_sparse_bins_pass_raw_through() -> None:
    cal = Calibrator(k=3, min_count=8)
    lc = torch.log(torch.tensor([[0.3, 0.6, 0.95]]))
    torch.testing.assert_close(calibrate(cal, lc), lc)
    wider = torch.log(torch.full((2, 5), 0.5))  # positions beyond k pass through
    torch.testing.assert_close(calibrate(cal, wider), wider)


def test_calibrate_matches_host_reference() -> None:
    """The lookup table gives the same calibrated values as the host formula, and
    positions past the calibrator's k pass through."""
    gen = torch.Generator().manual_seed(1)
    cal = Calibrator(k=6, bins=5)
    simulate(cal, 3, gen)
    lc = torch.rand(4, 6, generator=gen).clamp_min(1e-3).log()
    expected = reference_prob(cal, lc.double()).log().float()
    torch.testing.assert_close(calibrate(cal, lc), expected, atol=1e-5, rtol=1e-5)
    wider = torch.cat([lc, lc[:, :2]], dim=1)
    torch.testing.assert_close(calibrate(cal, wider)[:, 6:], lc[:, :2])



def test_a_position_never_verified_is_mapped_as_the_deepest_one_that_was():
    """An under-confident drafter: raw 0.3 everywhere, every draft accepted. Only positions 0-1 are ever verified;
    position 2-3 drafts are calibrated as position 1's, not left at raw 0.3 (which would keep them cut forever)."""
    cal = Calibrator(k=4, bins=5, min_count=8)
    for _ in range(40):
        cal.update(torch.full((4, 4), math.log(0.3)), torch.full((4,), 2), torch.full((4,), 2))
    assert cal.count.sum(1).tolist() == [160, 160, 0, 0]
    out = calibrate(cal, torch.full((1, 4), math.log(0.3))).exp()[0]
    assert float(out[1]) > 0.9 and float(out[2]) == pytest.approx(float(out[1])) == pytest.approx(float(out[3]))
    thin = Calibrator(k=4, bins=5, min_count=8)  # nothing verified anywhere: raw passes through
    torch.testing.assert_close(calibrate(thin, torch.full((1, 4), math.log(0.3))), torch.full((1, 4), math.log(0.3)))


def test_a_thin_bin_is_corrected_by_what_its_position_shows():
    """An under-confident drafter (raw 0.05-0.15, every draft accepted): a bin seen too rarely to stand alone is
    mapped as raw times its position's ratio of acceptances to raw confidence, not left at raw (which priced
    the MoE pair's deep drafts far below what they delivered); the ratio keeps the bins' order."""
    cal = Calibrator(k=2, bins=10, min_count=8)
    for _ in range(40):
        cal.update(torch.full((4, 2), math.log(0.05)), torch.full((4,), 2), torch.full((4,), 2))
    cal.update(torch.full((2, 2), math.log(0.15)), torch.full((2,), 2), torch.full((2,), 2))  # bin 1: 2 outcomes
    out = calibrate(cal, torch.log(torch.tensor([[0.05, 0.15], [0.02, 0.03]]))).exp()
    assert float(out[0, 0]) > 0.95 and float(out[0, 1]) == pytest.approx(1.0)  # clamped at 1
    assert 0.3 < float(out[1, 0]) < float(out[1, 1]) < 1.0  # bin 0 shared by both: counted, so near 0.97
    expected = reference_prob(cal, torch.log(torch.tensor([[0.05, 0.15], [0.02, 0.03]])).double()).float()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_thin_position_takes_the_fallbacks_counts_before_an_earlier_positions():
    """The MoE pair's case: position 0 confident (raw 0.9, half accepted), deeper drafts under-confident (raw 0.05,
    all accepted). The width's own calibrator has seen position 2 too rarely and would borrow position 1's
    mapping; the pooled calibrator has seen position 2 often, so the width takes its counts there. The table
    follows the fallback's later updates."""
    pooled = Calibrator(k=4, bins=10, min_count=8)
    own = Calibrator(k=3, bins=10, min_count=8, fallback=pooled)
    conf = torch.log(torch.tensor([[0.9, 0.9, 0.05, 0.05]] * 4))
    for _ in range(40):  # positions 0-1: raw 0.9, position 1 half accepted; position 2: raw 0.05, accepted
        accepted = torch.tensor([1, 1, 3, 3])
        pooled.update(conf, torch.full((4,), 3), accepted)
    for _ in range(10):  # the width's own: positions 0-1 well seen, position 2 only twice
        own.update(conf[:, :3], torch.tensor([2, 2, 2, 3]), torch.tensor([1, 1, 2, 2]))
    assert own.count.sum(1).tolist()[2] < 32 <= pooled.count.sum(1).tolist()[2]
    probe = torch.log(torch.tensor([[0.9, 0.9, 0.05]]))
    assert float(calibrate(own, probe).exp()[0, 2]) > 0.9  # pooled position 2: raw 0.05 is accepted
    alone = Calibrator(k=3, bins=10, min_count=8)
    alone.load(own.state())
    assert float(calibrate(alone, probe).exp()[0, 2]) < 0.5  # its own 10 observations there: rejected
    for _ in range(40):  # the pooled calibrator learns position 2's drafts are now rejected
        pooled.update(conf, torch.full((4,), 3), torch.full((4,), 2))
    assert float(calibrate(own, probe).exp()[0, 2]) < 0.7
    with pytest.raises(ValueError):
        Calibrator(k=5, bins=10, fallback=pooled)
