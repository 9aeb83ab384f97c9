"""Dataset-building command line: build, embed, verify and inspect WebDataset shards.

Imports the library's ``mmpretrain.data`` and ``mmpretrain.process`` only (never the trainer)."""

__version__ = "0.1.0"
