"""The families and preset sizes of the checkpoints `make-model` generates, without torch, so
the config schema (`model.generate`) offers exactly what `checkpoint_maker` makes.
"""

from __future__ import annotations

from typing import Literal, get_args

Family = Literal["llama", "qwen2"]
Size = Literal["tiny", "medium", "small"]
FAMILIES: tuple[Family, ...] = get_args(Family)
SIZES: tuple[Size, ...] = get_args(Size)
