"""hzpsim: which way of splitting an LLM training run wins on a cluster, and why.

Run ``hzpsim run`` for the built-in default scenario; see README.md.
"""

__version__ = "0.1.0"
