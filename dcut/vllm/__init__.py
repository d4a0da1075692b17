"""The D-Cut plugin for vLLM 0.32 (entry point ``vllm.general_plugins: dcut``).

Loaded by vLLM in every process; it patches nothing that changes behaviour unless an engine asks
for D-Cut with ``additional_config={"dcut": {...}}`` (see ``dcut.settings.DCutSettings``).
"""


def register() -> None:
    """vLLM plugin entry point."""
    from dcut.vllm.patches import install

    install()
