"""Shared infrastructure that imports no project module: typed config fields, name registries, atomic checkpoint
files, the metrics logger and storage offload. relibra/ and rollout/ may use it."""
