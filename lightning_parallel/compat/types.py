"""Type aliases the Lightning layer shares (Lightning's own are private)."""

from __future__ import annotations

import os
from typing import Union

__all__: list[str] = []

StrPath = Union[str, "os.PathLike[str]"]
