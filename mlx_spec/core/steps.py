"""Work written as a generator that yields its steps and returns its result.

A prefill yields between its chunks, a drafter between its model passes, a round between
its forwards: a batch (`mlx_spec.core.batch`) interleaves such generators, running their passes
beside each other's; alone, `drive` runs one to its end.
"""

from __future__ import annotations

from typing import Callable, Generator, Optional, TypeVar

Result = TypeVar("Result")


def drive(steps: Generator[object, None, Result], each: Optional[Callable[[object], None]] = None) -> Result:
    """Run `steps` to its end, handing each yielded item to `each` (if given) before
    resuming it. Returns the generator's return value."""
    while True:
        try:
            item = next(steps)
        except StopIteration as done:
            return done.value
        if each is not None:
            each(item)
