"""In-process benchmarks on real vLLM engines (no HTTP): measured generation and the batch-size sweep.

Used by the ``dcut`` command line; the plugin (``dcut.vllm``) never imports this package.
"""
