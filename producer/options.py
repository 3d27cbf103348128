"""Option types shared by commands; click and torch-free config only, so the bench
imports them without the database stack (benchmarks/gpu_check.sh runs it alone)."""

from __future__ import annotations

from typing import Any

import click

from eagle2_core.config import AUTO


class TreeSize(click.ParamType):
    """--total-tokens: 'auto' or a number of tree nodes >= 1."""

    name = "auto|N"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        if isinstance(value, int) or value == AUTO:
            return value
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number < 1:
            self.fail(f"{value!r} is neither 'auto' nor an integer >= 1", param, ctx)
        return number


TREE_SIZE_HELP = (
    "Tree nodes verified per EAGLE-2 round. 'auto' sizes every round's tree to this "
    "device's measured forward costs and the draft's confidence (it shrinks to the root "
    "alone where speculation cannot pay); a number fixes it."
)
