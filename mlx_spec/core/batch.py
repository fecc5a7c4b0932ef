"""A continuous batch: requests' rounds stepped together, their forwards shared.

Each request keeps everything of its own: its `SequenceCache`s (so rollback, sliding
windows and the prompt-cache pool work as for one request), drafter, γ policy, sampling,
stats and stop handling. `Engine.rounds(batched=True)` yields each pass of a round instead
of running it (`mlx_spec.core.passes`); `Batch.step` collects every request's pass and runs each
model's in one forward (`run_passes`), so only the forwards are shared.
"""

from __future__ import annotations

from mlx_spec.core.passes import Pass, TargetPass, run_passes


class _Prefilling:
    """Yielded by a request between its prompt's prefill chunks: no pass this step."""

    def __repr__(self) -> str:
        return "PREFILLING"


PREFILLING = _Prefilling()


class _RanAlone:
    """Yielded by a request after a round it ran without the batch (`Engine.rounds(alone=...)`):
    its passes this step have run."""

    def __repr__(self) -> str:
        return "RAN_ALONE"


RAN_ALONE = _RanAlone()


class Batch:
    """Generators that yield passes (`Engine.rounds(batched=True)`, or anything that passes
    them up), stepped together. Each `step` resumes every decoding one up to its next pass;
    while any of them has yielded a draft step's pass (a `DraftPass`, or the MTP
    assistant's), those run (one forward per draft model)
    and their generators resume, until each has yielded its `TargetPass` (a row with
    shorter chains, or none, waits for the others); then the target passes run in one
    forward, and each generator that is prefilling feeds its next prompt chunk (it yields
    `PREFILLING` after each). So N rows' draft step costs one forward, as their verify
    does, and a long prompt costs the others one chunk a round, after their tokens, never
    its whole prefill. Generators join (`add`) and leave (they end) between steps.
    A generator that finds itself `alone` may run its round itself and yield `RAN_ALONE`.
    Whatever else a generator yields goes to `out`."""

    def __init__(self, out=None):
        self.active: list = []
        self.out = out
        self.prefilling: set = set()  # generators whose last item was PREFILLING
        self.ready: dict = {}  # generator -> the pass it yielded after its prefill's last chunk
        self.resumed = None  # the generator being resumed

    def __len__(self) -> int:
        return len(self.active)

    def add(self, generator) -> None:
        self.active.append(generator)

    def alone(self) -> bool:
        """Whether the generator being resumed has no pass to share this step: every other
        one is prefilling (a chunk of its own; one just added may have a pass, so it counts)."""
        return all(g in self.prefilling for g in self.active if g is not self.resumed)

    def _advance(self, generator):
        """Resume `generator` to its next pass, PREFILLING or RAN_ALONE (None once it ends)."""
        self.resumed = generator
        try:
            item = next(generator)
            while not isinstance(item, Pass) and item is not PREFILLING and item is not RAN_ALONE:
                if self.out is not None:
                    self.out(generator, item)
                item = next(generator)
        except StopIteration:
            self.active.remove(generator)
            self.prefilling.discard(generator)
            return None
        return item

    def _run(self, pending: dict) -> None:
        """Run the passes of `pending` (generator -> its pass). If that fails, every
        request in it fails with the error (each generator may answer it, as a worker's
        job does) and leaves `pending`; the others go on."""
        try:
            run_passes(list(pending.values()))
        except Exception as error:
            for generator in list(pending):
                del pending[generator]
                self.active.remove(generator)
                try:
                    generator.throw(error)
                except StopIteration:
                    pass
                finally:
                    generator.close()

    def step(self) -> list:
        """One round of every active generator; returns those whose target pass it ran, or
        who ran their round alone (its rows)."""
        pending, prefilling, alone = {}, list(self.prefilling), []
        for generator in [g for g in self.active if g not in self.prefilling]:
            item = self.ready.pop(generator, None) or self._advance(generator)
            if item is PREFILLING:
                self.prefilling.add(generator)
            elif item is RAN_ALONE:
                alone.append(generator)
            elif item is not None:
                pending[generator] = item
        while drafting := {g: p for g, p in pending.items() if not isinstance(p, TargetPass)}:
            self._run(drafting)
            for generator in [g for g in pending if not isinstance(pending[g], TargetPass)]:
                if generator in drafting:
                    item = self._advance(generator)
                    if item is not None:
                        pending[generator] = item
                        continue
                del pending[generator]
        if pending:
            self._run(pending)
        for generator in prefilling:  # one chunk each, after the others' round
            item = self._advance(generator)
            if isinstance(item, Pass):
                self.prefilling.discard(generator)
                self.ready[generator] = item  # run with the others' next step
            elif item is RAN_ALONE:  # its prefill's end, then a first round of its own
                self.prefilling.discard(generator)
                alone.append(generator)
        return list(pending) + alone
