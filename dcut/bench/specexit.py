"""SpecExit measured on the reasoning pair's held-out problems: what ``dcut specexit`` runs.

Arms, on one engine (SpecExit enabled engine-wide, each request says whether and how it uses it):
- ``none``: no exit; the thinking ends when the target ends it;
- ``cap:N``: what other engines offer, a thinking budget: after N generated tokens without ``</think>`` the
  engine's output is cut there, ``</think>`` is appended and the answer generated from that context;
- ``specexit`` / ``specexit:key=value,…``: SpecExit at the deployment's settings, or with thresholds overridden.

Per arm and batch size: accuracy, mean generated and thinking tokens, tokens/s, end-to-end latency per request
(engine-side, from vLLM's request timestamps) and the exits taken.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcut.settings import EngineSettings
from dcut.specexit import SpecExitSettings
from dcut.vllm.api import read_specexit_usage


@dataclass(frozen=True)
class Arm:
    name: str
    cap: int | None = None  # thinking tokens before </think> is forced
    specexit: dict[str, Any] | None = None  # SpecExit overrides ({} = the engine's settings); None: off


def parse_arm(text: str) -> Arm:
    """``none``, ``cap:N`` or ``specexit[:key=value,...]`` (values parsed as JSON, e.g. ``smoothing="window"``
    or ``remaining_max=null``); bad names and values are refused by SpecExit's settings, with their name."""
    kind, _, rest = text.strip().partition(":")
    if kind == "none" and not rest:
        return Arm("none")
    if kind == "cap":
        if not rest.isdigit() or int(rest) < 1:
            raise ValueError(f"arm {text!r}: cap:N needs a positive number of thinking tokens")
        return Arm(text, cap=int(rest))
    if kind == "specexit":
        overrides: dict[str, Any] = {}
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"arm {text!r}: expected key=value, got {item!r}")
            try:
                overrides[key.strip()] = json.loads(value)
            except json.JSONDecodeError:
                overrides[key.strip()] = value
        SpecExitSettings.model_validate(overrides)
        return Arm(text, specexit=overrides)
    raise ValueError(f"unknown arm {text!r}: choose none, cap:N or specexit[:key=value,...]")


def answer_of(completion: str, think_end: str = "</think>") -> str | None:
    """The answer a reasoning completion gives: the first number after ``think_end`` (None without one). How this
    benchmark scores a request, and the trainer (`train/`) its vLLM check of the reasoning pair."""
    _, sep, after = completion.partition(think_end)
    match = re.search(r"-?\d+", after) if sep else None
    return match.group(0) if match else None


def load_problems(path: str | Path) -> list[dict[str, str]]:
    """Held-out problems: ``.jsonl`` of ``{"prompt": ..., "answer": ...}``."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows or not all(isinstance(r, dict) and "prompt" in r and "answer" in r for r in rows):
        raise ValueError(f"{path}: expected JSON lines with 'prompt' and 'answer'")
    return rows


def evaluate(settings: EngineSettings, problems: list[dict[str, str]], arms: list[Arm], batch_sizes: list[int],
             max_tokens: int) -> list[dict[str, Any]]:
    """One row per (batch size, arm): the problems decoded greedily ``bs`` at a time."""
    from tqdm import tqdm
    from vllm import LLM

    from dcut.bench.generate import _build_engine
    from dcut.vllm.engine import engine_kwargs

    engine = settings.model_copy(update={"max_num_seqs": max(batch_sizes),
                                         "specexit": settings.specexit or SpecExitSettings()})
    llm = _build_engine(LLM, {**engine_kwargs(engine), "disable_log_stats": False})
    tok = llm.get_tokenizer()
    think_end = tok.convert_tokens_to_ids(engine.specexit.think_end)
    prompt_ids = [tok.encode(p["prompt"], add_special_tokens=False) for p in problems]
    rows = []
    with tqdm(total=len(batch_sizes) * len(arms) * len(problems), desc="specexit", unit="req") as bar:
        for bs in batch_sizes:
            _run(llm, prompt_ids[:bs], Arm("none"), max_tokens, think_end)  # warm-up
            for arm in arms:
                started, done = time.perf_counter(), []
                for i in range(0, len(problems), bs):
                    done += _run(llm, prompt_ids[i:i + bs], arm, max_tokens, think_end)
                    bar.update(len(prompt_ids[i:i + bs]))
                wall = time.perf_counter() - started
                rows.append(_row(arm, bs, problems, done, wall, tok, think_end))
    return rows


def _run(llm: Any, prompts: list[list[int]], arm: Arm, max_tokens: int, think_end: int) -> list[dict[str, Any]]:
    """Generate one batch under ``arm``: per request, its token ids, latency and exit."""
    from vllm import SamplingParams

    flag = "false" if arm.specexit is None else json.dumps(arm.specexit)
    first = SamplingParams(max_tokens=arm.cap or max_tokens, temperature=0.0,
                           extra_args={"specexit": flag})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], first, use_tqdm=False)
    usage = read_specexit_usage(llm) if arm.specexit is not None else {}
    results = []
    for out in outs:
        exited = any(u["exited"] for r, u in usage.items() if r.startswith(f"{out.request_id}-"))
        results.append({"ids": list(out.outputs[0].token_ids), "latency_s": _latency(out), "exited": exited})
    capped = [i for i, r in enumerate(results)
              if arm.cap is not None and think_end not in r["ids"] and len(r["ids"]) >= arm.cap]
    if capped:  # the budget ran out: </think> appended, the answer generated from there, as one batch
        rest = llm.generate([{"prompt_token_ids": prompts[i] + results[i]["ids"] + [think_end]} for i in capped],
                            SamplingParams(max_tokens=max(1, max_tokens - arm.cap - 1), temperature=0.0,
                                           extra_args={"specexit": "false"}), use_tqdm=False)
        for i, out in zip(capped, rest, strict=True):
            results[i]["ids"] += [think_end, *out.outputs[0].token_ids]
            results[i]["latency_s"] += _latency(out)
    return results


def _latency(out: Any) -> float:
    """Queued to last token, from the engine core's own clock."""
    m = out.metrics
    return max(0.0, m.last_token_ts - m.queued_ts) if m is not None else float("nan")


def _row(arm: Arm, bs: int, problems: list[dict[str, str]], done: list[dict[str, Any]], wall: float, tok: Any,
         end: int) -> dict[str, Any]:
    texts = [tok.decode(d["ids"]) for d in done]
    correct = [answer_of(t) == p["answer"] for t, p in zip(texts, problems, strict=True)]
    tokens = [len(d["ids"]) for d in done]
    thinking = [d["ids"].index(end) + 1 if end in d["ids"] else len(d["ids"]) for d in done]
    lat = sorted(d["latency_s"] for d in done)
    return {
        "arm": arm.name, "bs": bs, "requests": len(done), "accuracy": round(sum(correct) / len(done), 4),
        "mean_tokens": round(statistics.mean(tokens), 1), "mean_thinking_tokens": round(statistics.mean(thinking), 1),
        "exits": sum(d["exited"] for d in done), "tokens_per_s": round(sum(tokens) / wall, 1),
        "wall_s": round(wall, 2), "latency_mean_s": round(statistics.mean(lat), 3),
        "latency_p50_s": round(lat[len(lat) // 2], 3), "latency_p90_s": round(lat[int(0.9 * (len(lat) - 1))], 3),
    }
