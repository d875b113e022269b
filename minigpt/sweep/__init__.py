"""The context-length sweep: search (what to try), runner (a trial in a fresh process), report (tables, plots,
W&B), sweep (the command line); and curves (training curves of finished runs)."""
