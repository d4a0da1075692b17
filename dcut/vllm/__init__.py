"""The D-Cut plugin for vLLM 0.32 (entry point ``vllm.general_plugins: dcut``).

Loaded by vLLM in every process; it patches nothing that changes behaviour unless an engine asks
for D-Cut with ``additional_config={"dcut": {...}}`` (see ``dcut.settings.DCutSettings``). In a child process
(engine core, TP worker) it also makes the process die with its parent (``dcut.vllm.lifeline``).
"""


def register() -> None:
    """vLLM plugin entry point."""
    from dcut.vllm.lifeline import watch_parent
    from dcut.vllm.patches import install

    watch_parent()
    install()
