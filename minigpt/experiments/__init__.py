"""Experiments built on the trainer: the context-length sweep and the attention benchmark."""
