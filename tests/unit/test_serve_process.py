"""The one model-name rule of the tools that serve an app (`loadtest.serve_process.served`), without serving."""

from __future__ import annotations

from pathlib import Path

import httpx

from loadtest import serve_process
from loadtest.serve_process import model_name, served

REPO = Path(__file__).resolve().parents[2]


def test_model_name_is_the_flag_else_what_the_config_serves():
    assert model_name("mine", REPO / "app.config.yaml", "http://127.0.0.1:1") == "mine"
    assert model_name(None, REPO / "app.config.yaml", "http://127.0.0.1:1") == "deep"  # served_model_name
    assert model_name("", REPO / "app.reasoning.config.yaml", "http://127.0.0.1:1") == "reasoning"  # folder name


def test_without_a_config_the_model_is_the_first_one_the_app_lists(monkeypatch):
    asked = []

    def get(url, headers, timeout):
        asked.append((url, headers))
        return httpx.Response(200, json={"data": [{"id": "first"}, {"id": "second"}]},
                              request=httpx.Request("GET", url))

    monkeypatch.setattr(serve_process.httpx, "get", get)
    with served(None, "http://127.0.0.1:8000/", api_key="k") as app:  # an app already served: nothing started
        assert app.process is None and app.model == "first"
    assert asked == [("http://127.0.0.1:8000/v1/models", {"Authorization": "Bearer k"})]
