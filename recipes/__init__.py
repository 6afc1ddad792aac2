"""Hydra entry points. The only package that imports hydra/omegaconf: it composes configs/ over the typed
dataclasses of `tppo.config`, converts once, validates once, and hands plain dataclasses to the library."""
