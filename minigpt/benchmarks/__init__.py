"""Measurements that print tables and write JSON: the attention benchmark (bench), ring attention (ring_bench),
where a step's memory goes (memory_profile), and a table of finished training runs (training_table)."""
