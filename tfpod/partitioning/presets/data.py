"""data: data parallelism. Every weight replicated, the batch split over `data`."""

from tfpod.partitioning.presets.base import Preset

PRESET = Preset("data", {"batch": "data"}, "every weight replicated, the batch split over `data`")
