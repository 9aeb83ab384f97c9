"""Dataset-building command line: build, embed, verify and inspect WebDataset shards.

Imports ``mmpretrain.data`` only (never the trainer)."""

__version__ = "0.1.0"
