"""Platforms: where graphs run. See :mod:`tapml.platforms.base` for the interface."""
