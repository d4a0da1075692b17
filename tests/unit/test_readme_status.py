"""The README's status block is what ``dcut report status`` computes from the committed result files: a figure
edited by hand, or a result file re-measured without the README regenerated, fails here."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from dcut.cli import main
from dcut.status_report import BEGIN, END, LIVE_POOLED, block, readme_block, rows, trace_acceptance, with_block

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_the_readme_holds_the_block_the_command_computes():
    held, computed = readme_block(README.read_text()), block(ROOT)
    assert held == computed, "README.md's status block differs from its data: `dcut report status --write README.md`"


def test_a_figure_edited_by_hand_is_caught(tmp_path, capsys):
    text = README.read_text()
    edited = tmp_path / "README.md"
    figure = re.search(r"\| (\d\.\d{3}) [✓✗] \|", readme_block(text)).group(1)
    edited.write_text(text.replace(f"| {figure} ", f"| {float(figure) + 0.01:.3f} ", 1))
    assert main(["report", "status", "--root", str(ROOT), "--check", str(edited)]) == 1
    assert figure in capsys.readouterr().out  # the diff names the figure the data gives
    assert main(["report", "status", "--root", str(ROOT), "--check", str(README)]) == 0


def test_a_result_file_re_measured_changes_the_block(tmp_path):
    """Copy the results, move one pooled figure below the bar: the block follows the data, verdict included."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs" / "results", root / "docs" / "results")
    pooled = json.loads((root / LIVE_POOLED).read_text())
    pooled["rows"][0]["best"]["ratio"] = 0.9
    (root / LIVE_POOLED).write_text(json.dumps(pooled))
    live = next(r for r in rows(root) if r.source == LIVE_POOLED)
    assert live.cells()[0] == "0.900 ✗"
    assert block(root) != block(ROOT)


def test_every_cell_is_judged_against_its_bar_at_the_shown_precision():
    for row in rows(ROOT):
        for bs, cell in zip((1, 4, 8, 16, 32, 64), row.cells(), strict=True):
            if bs not in row.figures:
                assert cell == "–"
                continue
            shown = float(cell.split()[0])
            assert cell.endswith("✓") == (shown >= row.bar)


def test_write_replaces_only_the_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\n{BEGIN}\nold\n{END}\n\nrest\n")
    assert main(["report", "status", "--root", str(ROOT), "--write", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# title\n\n") and text.endswith(f"{END}\n\nrest\n") and readme_block(text) == block(ROOT)
    assert with_block(text, "x") == f"# title\n\n{BEGIN}\nx\n{END}\n\nrest\n"
    readme.write_text("no markers\n")
    with pytest.raises(ValueError):
        readme_block(readme.read_text())
    assert main(["report", "status", "--root", str(ROOT), "--check", str(readme)]) == 2


def test_the_deep_cards_quote_the_committed_traces_acceptance(capsys):
    """The deep pair's cards quote mean accepted drafts per width from the committed trace, as the command prints."""
    assert main(["report", "acceptance", "--trace", str(ROOT / "docs/results/replay/traces/deep")]) == 0
    printed = capsys.readouterr().out.strip()
    assert round(trace_acceptance(ROOT / "docs/results/replay/traces/deep")[15][0], 2) == 3.52
    for card in ("models/deep/README.md", "models/deep-dflash/README.md"):
        text = (ROOT / card).read_text()
        assert readme_block(text, "<!-- acceptance:begin -->", "<!-- acceptance:end -->") == printed, card


def test_the_status_says_what_the_live_results_do_not_cover(tmp_path):
    """Until a live run has the stock arm and sampled traffic, the status says so; once it has, it stops saying it."""
    import json

    from dcut.status_report import LIVE, _unmeasured

    live = tmp_path / LIVE
    live.parent.mkdir(parents=True)
    live.write_text(json.dumps({"modes": ["none", "full", "joint"]}))
    assert [m.split(" ")[0] for m in _unmeasured(tmp_path)] == ["vLLM's", "sampled"]
    live.write_text(json.dumps({"modes": ["none", "vllm", "joint"]}))
    mixed = tmp_path / LIVE.replace("/live/", "/live-mixed/")
    mixed.parent.mkdir(parents=True)
    mixed.write_text("{}")
    assert _unmeasured(tmp_path) == []
