"""The D-Cut plugin for vLLM 0.32 (entry point ``vllm.general_plugins: dcut``).

Loaded by vLLM in every process; it patches nothing that changes behaviour unless an engine asks
for D-Cut with ``additional_config={"dcut": {...}}`` (see ``dcut.settings.DCutSettings``), except two
fixes of vLLM bugs that apply to every engine (``dcut.vllm.vllm_fixes``; opt out with ``DCUT_VLLM_FIXES=0``).
In a child process (engine core, TP worker) it also makes the process die with its parent
(``dcut.vllm.lifeline``). What is patched, and what moving to vLLM's V2 model runner would take:
``dcut/vllm/README.md``.
"""

EXPECTED_VLLM_VERSION = "0.32.0"  # the vLLM release every patch (dcut.vllm.patches) was written for


def register() -> None:
    """vLLM plugin entry point."""
    from dcut.vllm.lifeline import watch_parent
    from dcut.vllm.patches import install

    watch_parent()
    install()
