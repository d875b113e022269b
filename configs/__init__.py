"""The Hydra config tree (configs/ in the source tree), installed as the package `minigpt.configs`."""
