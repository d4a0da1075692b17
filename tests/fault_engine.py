"""An engine that fails on demand, for the Serve fault tests (``compose_app(args, engine_cls=FaultyEngine)``):
a real `VLLMEngine` whose admission raises for a prompt containing ``MARKER``."""

from __future__ import annotations

from typing import Any

from deployments.vllm_engine import VLLMEngine

MARKER = "__inject_fault__"


class InjectedEngineFault(RuntimeError):
    """An engine fault the test asked for."""


class FaultyEngine(VLLMEngine):
    def admit(self, prompt: Any, request_id: str) -> None:
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        if text is None and isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text = self.engine.renderer.tokenizer.decode(prompt["prompt_token_ids"])
        if text and MARKER in text:
            raise InjectedEngineFault(f"injected engine fault (request {request_id})")
