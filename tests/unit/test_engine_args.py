"""The command line's engine flags: an embedded pair by name, explicit folders winning, clear errors."""

import argparse

import pytest

from dcut.cli import CommandError
from dcut.commands.engine_args import add_engine_flags, engine_settings, parse_schedule
from dcut.settings import EMBEDDED_MODELS


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    return p.parse_args(argv)


@pytest.mark.parametrize("pair", sorted(EMBEDDED_MODELS))
def test_pair_names_its_embedded_folders(pair, monkeypatch, tmp_path):
    model, draft = EMBEDDED_MODELS[pair]
    for folder in (model, draft):
        (tmp_path / folder).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    s = engine_settings(_parse("--pair", pair))
    assert (s.model, s.draft) == (model, draft)


def test_explicit_folders_override_the_pair_and_must_exist(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "d").mkdir()
    s = engine_settings(_parse("--pair", "moe", "--model", str(tmp_path / "t"), "--draft", str(tmp_path / "d")))
    assert (s.model, s.draft) == (str(tmp_path / "t"), str(tmp_path / "d"))
    with pytest.raises(CommandError, match="model folder not found"):
        engine_settings(_parse("--model", str(tmp_path / "t"), "--draft", str(tmp_path / "nope")))
    assert engine_settings(_parse("--model", str(tmp_path / "t"), "--draft", str(tmp_path / "nope")),
                           need_draft=False).model == str(tmp_path / "t")


def test_schedule_parses_or_says_what_it_expected():
    assert parse_schedule("1-4:15,5-64:3") == [(1, 4, 15), (5, 64, 3)]
    with pytest.raises(argparse.ArgumentTypeError, match="lo-hi:K"):
        parse_schedule("1:15")


def test_unset_flags_leave_the_settings_defaults_and_set_ones_pass_through(monkeypatch, tmp_path):
    from dcut.settings import DCutSettings, EngineSettings

    for folder in EMBEDDED_MODELS["deep"]:
        (tmp_path / folder).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    s = engine_settings(_parse("--pair", "deep"))
    assert s.model_dump(exclude={"model", "draft"}) == EngineSettings().model_dump(exclude={"model", "draft"})
    s = engine_settings(_parse("--pair", "deep", "--k", "7", "--tp", "2", "--no-calibrate", "--fixed-ratio", "0.3",
                               "--enforce-eager"))
    assert (s.num_speculative_tokens, s.tensor_parallel_size, s.enforce_eager) == (7, 2, True)
    assert (s.dcut.calibrate, s.dcut.fixed_ratio, s.dcut.zero_width) == (False, 0.3, DCutSettings().zero_width)


def test_cli_mode_auto_is_refused_naming_its_new_name(capsys):
    """``dcut generate --mode auto`` and ``dcut sweep --modes ...,auto``: the error names ``reference``."""
    from dcut.bench.sweep import SWEEP_MODES
    from dcut.cli import main
    from dcut.commands.engine_args import batch_sizes_and_modes

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--mode", "auto"])
    assert exit_.value.code == 2 and "mode 'auto' was renamed to 'reference'" in capsys.readouterr().err
    with pytest.raises(CommandError, match="mode 'auto' was renamed to 'reference'"):
        batch_sizes_and_modes("1,4", "none,auto", SWEEP_MODES)
    assert batch_sizes_and_modes("4,1", "none,reference", SWEEP_MODES) == ([1, 4], ["none", "reference"])


def test_prefix_caching_reaches_vllm_only_when_set() -> None:
    """The live benchmarks turn prefix caching off in every arm (EngineSettings.prefix_caching says why); left
    unset, vLLM's default stands."""
    from dcut.settings import EngineSettings
    from dcut.vllm.engine import engine_kwargs

    assert "enable_prefix_caching" not in engine_kwargs(EngineSettings())
    assert engine_kwargs(EngineSettings(prefix_caching=False))["enable_prefix_caching"] is False
    assert engine_kwargs(EngineSettings(method="none", draft=None, dcut=None,
                                        prefix_caching=False))["enable_prefix_caching"] is False


def test_token_prompts_have_exactly_the_length_asked() -> None:
    from dcut.prompts import load_prompts, token_prompts

    prompts = token_prompts(load_prompts("models/heldout_prompts.jsonl"), "models/deep/tokenizer.json", 1000, 70)
    assert len(prompts) == 70 and {len(p["prompt_token_ids"]) for p in prompts} == {1000}
    assert prompts[0]["prompt_token_ids"] != prompts[1]["prompt_token_ids"]  # each starts where the last ended
    with pytest.raises(ValueError):
        token_prompts(["x"], "models/deep/tokenizer.json", 0, 1)


def test_compare_refuses_prompts_longer_than_the_context_allows(capsys) -> None:
    from dcut.cli import main

    assert main(["compare", "--out", "/tmp/never", "--modes", "none,joint", "--prompt-tokens", "1000",
                 "--max-tokens", "128"]) == 2
    assert "--prompt-tokens must be 1..max_model_len - max_tokens (896)" in capsys.readouterr().err
