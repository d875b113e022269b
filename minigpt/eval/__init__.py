"""Evaluation: `minigpt-eval` (cli) for loss by position on held-out pycode (loss_by_position, bootstrap,
loss_report, heldout) and the passkey grid (retrieval: the grid; haystack: prompts in any tokenizer's tokens;
passkey_grid: tables and heatmaps), and the held-out loss and key accuracy of a batch split over ranks (global_batch)."""
