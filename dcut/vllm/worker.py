"""Worker-side RPCs (vLLM ``worker_extension_cls``) to read D-Cut state from a running engine."""

from __future__ import annotations

from typing import Any

from dcut.vllm.runner_hooks import runner_dcut, runner_specexit


class DCutWorkerExtension:
    """Mixed into vLLM's worker class; called through ``collective_rpc("dcut_...")``."""

    def dcut_stats(self) -> dict[str, Any] | None:
        """The runner's `DCutSnapshot` as JSON (what vLLM's RPC carries); `dcut.vllm.api` validates it back."""
        state = runner_dcut(self.model_runner)  # type: ignore[attr-defined]
        return None if state is None else state.snapshot().model_dump(mode="json")

    def dcut_cost_table(self) -> dict[str, Any] | None:
        state = runner_dcut(self.model_runner)  # type: ignore[attr-defined]
        return None if state is None or state.cost_table is None else state.cost_table.to_json()

    def dcut_reset_stats(self) -> None:
        state = runner_dcut(self.model_runner)  # type: ignore[attr-defined]
        if state is not None:
            state.reset_stats()

    def dcut_save_trace(self) -> str | None:
        """Write the replay trace recorded so far (``DCutSettings.trace``); its path, None when not tracing."""
        state = runner_dcut(self.model_runner)  # type: ignore[attr-defined]
        path = None if state is None else state.save_trace()
        return None if path is None else str(path)

    def dcut_clear_trace(self) -> None:
        state = runner_dcut(self.model_runner)  # type: ignore[attr-defined]
        if state is not None and state.tracer is not None:
            state.tracer.clear()

    def dcut_specexit_stats(self) -> dict[str, Any] | None:
        """SpecExit's counters and settings (``dcut.vllm.specexit.RunnerSpecExit.stats``); None when off."""
        state = runner_specexit(self.model_runner)  # type: ignore[attr-defined]
        return None if state is None else state.stats()

    def dcut_specexit_usage(self, prefix: str) -> dict[str, dict[str, Any]]:
        """What SpecExit did for the requests whose engine id starts with ``prefix``."""
        state = runner_specexit(self.model_runner)  # type: ignore[attr-defined]
        return {} if state is None else state.usage(prefix)

    def dcut_request_usage(self, prefix: str) -> dict[str, dict[str, Any]]:
        """What speculation did for the requests whose engine id starts with ``prefix`` (``dcut.speculation``)."""
        state = runner_dcut(self.model_runner)  # type: ignore[attr-defined]
        return {} if state is None else state.requests.usage(prefix)
