"""D-Cut: keep only the batch-wide most promising speculative drafts.

The package root imports neither vLLM nor Ray: the math can be read, tested and reused alone.
"""

__version__ = "0.2.0"
