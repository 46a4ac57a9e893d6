"""spatial: image models' rows over `model` (MLPerf's spatial partitioning).

Every weight replicated, the batch over `data` and each image's rows (`height`) over
`model`, with tfpod's own halo exchange (tfpod.partitioning.spatial). Only tasks that
declare `splits_image_rows` take it (Preset.check_run); `--mesh=auto` does not try it.
"""

from tfpod.partitioning.presets.base import Preset

PRESET = Preset("spatial", {"batch": "data", "height": "model"},
                "image rows over `model`, the batch over `data`, weights replicated", searched=False)
