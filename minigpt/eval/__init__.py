"""Evaluation: passkey retrieval (retrieval: the grid; passkey_eval: the command line) and the held-out loss and
key accuracy of a batch split over ranks (global_batch)."""
