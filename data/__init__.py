"""Token data for perfgpt: tokenizers, shard formats, loaders and the built-in default corpus.

Importing this package is cheap (no torch, numpy or optional dependency is imported here):
``training.config`` imports ``data.config`` on every run. Use ``data.loader.build_data`` to get
the training and validation streams.
"""
