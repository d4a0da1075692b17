"""The H20 roofline cost model: its fit to the seed's verify costs, its shape, and its cost-model JSON."""

from __future__ import annotations

import json

import pytest

from dcut.replay.costs import CostModel
from dcut.replay.roofline import (
    BLOCK,
    SEED_RATIOS,
    SEED_VERIFY_POINTS,
    SEED_VERIFY_TABLE,
    ModelShape,
    Roofline,
    fit_h20,
    h20_cost_model,
    residuals,
)


@pytest.fixture(scope="module")
def roof() -> Roofline:
    return fit_h20()


@pytest.fixture(scope="module")
def model() -> CostModel:
    return h20_cost_model()


def test_seed_points_are_the_table_cells_the_source_quotes() -> None:
    for bs, tokens, ms in SEED_VERIFY_POINTS:
        ratio = tokens / (bs * BLOCK)
        assert SEED_VERIFY_TABLE[bs][SEED_RATIOS.index(ratio)] == ms


def test_qwen3_8b_shape_adds_up_to_its_published_size() -> None:
    shape = ModelShape.qwen3_8b()
    total = shape.layers * shape.layer_params + 2 * shape.lm_head_params
    assert 8.1e9 < total < 8.3e9  # Qwen3-8B: 8.2B parameters (norms left out)
    assert shape.kv_bytes_per_token == 36 * 2 * 8 * 128 * 2


def test_fit_is_within_3_percent_at_the_six_points_and_7_percent_on_all_twenty(roof: Roofline) -> None:
    rows = residuals(roof)
    assert len(rows) == 20 and sum(r["fitted"] for r in rows) == 6
    assert all(abs(r["residual_pct"]) < 3.0 for r in rows if r["fitted"])
    assert all(abs(r["residual_pct"]) < 7.0 for r in rows)
    assert 0.2 <= roof.mem_eff <= 1.0 and 0.2 <= roof.compute_eff <= 1.0  # never above the published rates
    assert roof.t0_ms >= 0.0 and roof.per_request_ms >= 0.0


@pytest.mark.parametrize("bs", [1, 4, 16, 64])
def test_verify_is_non_decreasing_in_tokens(roof: Roofline, bs: int) -> None:
    costs = [roof.verify_ms(bs, t) for t in range(bs, bs * BLOCK + 1)]
    assert all(b >= a for a, b in zip(costs, costs[1:], strict=False))


@pytest.mark.parametrize("bs", [1, 4, 16, 64])
def test_none_step_is_a_verify_of_one_token_per_request(roof: Roofline, bs: int) -> None:
    assert roof.none_ms(bs) == roof.verify_ms(bs, bs)


@pytest.mark.parametrize("bs", [1, 4, 16, 64])
def test_draft_is_non_decreasing_in_width(roof: Roofline, bs: int) -> None:
    costs = [roof.draft_ms(bs, w) for w in range(BLOCK)]
    assert all(b >= a for a, b in zip(costs, costs[1:], strict=False))
    assert costs[0] < costs[1]  # width 0 keeps the drafter in sync only


def test_cost_model_round_trips_and_matches_the_roofline(roof: Roofline, model: CostModel) -> None:
    again = CostModel.from_json(json.loads(json.dumps(model.to_json())))
    assert again.to_json() == model.to_json()
    assert again.name == "h20-qwen3-8b" and again.table.fingerprint.hardware == "NVIDIA H20 (roofline model)"
    assert again.batch_sizes() == [1, 2, 4, 8, 16, 32, 64]
    for bs in again.batch_sizes():
        assert [p[0] for p in again.table.points[bs]] == [bs * (1 + d) for d in range(BLOCK)]
        for d in range(BLOCK):
            assert again.verify(bs, bs * (1 + d)) == pytest.approx(roof.verify_ms(bs, bs * (1 + d)))
        for w in range(BLOCK):
            assert again.draft(bs, w) == pytest.approx(roof.draft_ms(bs, w))
        assert again.none(bs) == pytest.approx(roof.none_ms(bs))
    assert again.overhead(10) == 0.0 and again.notes == model.notes


def test_cost_models_written_with_the_old_plain_key_still_read(model: CostModel) -> None:
    """``none``'s step costs were written under ``plain`` before (committed cost models keep that key)."""
    old = model.to_json()
    old["plain"] = old.pop("none")
    assert CostModel.from_json(old).none_ms == model.none_ms and model.none_ms


def test_build_is_deterministic(model: CostModel) -> None:
    assert json.dumps(h20_cost_model().to_json()) == json.dumps(model.to_json())
