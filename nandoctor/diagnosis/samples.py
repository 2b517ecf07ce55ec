"""Which samples of the failing batch cause the fault: bisection by replaying the failing phase on halves.

A half that still faults on its own is split again; the leaves found are the minimal set. Samples are named
only when they are special: the rest of the batch without them must replay clean. When no strict subset is
special the answer is None ("not sample-specific", `scope`), and `reason` says which case was measured,
because they point at different causes:

- every sample faults on its own (the weights, the step size, something all samples share);
- no part faults alone, only the batch together (an empty mask over the batch);
- the parts found fault, but so does the rest of the batch without them (a loss whose sum overflows once
  the weights diverged: any half of the batch overflows it, so the half bisection meets first says nothing).

Batch-norm layers stay in train mode (the failing condition), so a subset sees different batch
statistics: the caller notes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nandoctor.tensors.sizes import batch_size, subset

MAX_EVALS = 64

# `scope`: the report's evidence.samples_scope
SAMPLES = "samples"  # a strict subset of the batch faults alone, and the rest without it does not: named
NOT_SPECIFIC = "not_sample_specific"  # no strict subset is special: sample_indices is empty
# `reason` (evidence.samples_reason) when NOT_SPECIFIC
EVERY_SAMPLE = "every_sample"  # each sample of the batch faults on its own
WHOLE_BATCH = "whole_batch"  # no part faults alone, only the batch together (or part of it together)
REST_FAULTS = "rest_of_batch_faults"  # the parts found fault alone, and so does the batch without them


@dataclass
class Bisection:
    samples: list[int] | None
    evaluations: int = 0
    capped: bool = False
    notes: list[str] = field(default_factory=list)
    scope: str | None = None  # SAMPLES or NOT_SPECIFIC; None when nothing could be tried apart
    reason: str | None = None  # EVERY_SAMPLE, WHOLE_BATCH or REST_FAULTS when NOT_SPECIFIC


def find_samples(replayer: Any, fields: dict[str, Any], phase: str) -> Bisection:
    """Bisect the batch. The test matches the fault: `backward` re-runs backward too (a non-finite loss or
    gradient); `forward` looks for any non-finite layer output or loss; `loss` for a non-finite loss."""
    import paddle

    n = batch_size(fields)
    if n is None or n < 1:
        return Bisection(None, notes=["the batch has no common leading dimension to split"])
    evals = 0

    def faults(idx: list[int]) -> bool:
        nonlocal evals
        evals += 1
        part = subset(fields, idx)
        replayer.reset_rng()
        try:
            if phase == "forward":
                loss, bad_layer, _ = replayer.forward_outputs(part, None)
                return bad_layer is not None or not _finite(loss)
            if phase == "backward":
                loss = replayer.loss(part)
                if not _finite(loss):
                    return True
                loss.backward()
                grads = [p.grad for _, p in replayer.params if p.grad is not None]
                bad = any(not bool(paddle.isfinite(g).all()) for g in grads)
                return bad
            with paddle.no_grad():
                return not _finite(replayer.loss(part))
        except Exception:  # noqa: BLE001 - a subset the user's code cannot take says nothing
            return False
        finally:
            replayer.clear()

    if n == 1:
        return Bisection([0], 0, scope=SAMPLES)
    found: list[int] = []
    capped = together = False
    stack = [list(range(n))]
    while stack:
        idx = stack.pop()
        if len(idx) == 1:
            found += idx
            continue
        if evals + 2 > MAX_EVALS:
            capped = True
            found += idx
            continue
        half = len(idx) // 2
        left, right = idx[:half], idx[half:]
        lf, rf = faults(left), faults(right)
        if not lf and not rf:
            found += idx  # needs both halves together: this set is the smallest we can name
            together = True
            continue
        if rf:
            stack.append(right)
        if lf:
            stack.append(left)
    found = sorted(set(found))
    out = Bisection(found, evals, capped, scope=SAMPLES)
    if capped:
        out.notes.append(f"bisection stopped after {MAX_EVALS} replays; the samples named may be more than needed")
    if len(found) == n:
        # Every position would be no attribution at all (and "leave these samples out" would drop the
        # batch), so sample_indices is empty and the reason says which case was measured.
        out.samples = None
        if together:
            _not_specific(out, WHOLE_BATCH, "no strict subset of the samples faults alone: the batch as a whole is "
                                            "at fault, not particular samples")
        elif capped:
            out.scope = None
            out.notes.append("the replays ran out before the samples could all be tried apart")
        else:
            _not_specific(out, EVERY_SAMPLE, f"every one of the {n} samples faults on its own: the cause is common "
                                             "to all of them (the weights, the step, or something every sample "
                                             "shares), not particular samples")
    else:
        # Named samples must be why the batch faults: without them it must replay clean. When the rest faults
        # too (a loss's sum that overflows over any large enough part), the parts found are only the first
        # the bisection met, and dropping them would change nothing.
        rest = [i for i in range(n) if i not in set(found)]
        rest_faults = faults(rest)
        out.evaluations = evals
        if rest_faults:
            _not_specific(out, REST_FAULTS, f"the parts of the batch the bisection found ({len(found)} sample(s)) "
                                            f"fault on their own, and so do the other {len(rest)} samples without "
                                            "them: no strict subset of the batch is special (the weights or the "
                                            "scale of the values, not particular samples)")
    return out


def _not_specific(out: Bisection, reason: str, note: str) -> None:
    """No strict subset is special: no sample named (an empty list, as against None: not tried apart)."""
    out.samples, out.scope, out.reason = [], NOT_SPECIFIC, reason
    out.notes.append(note)


def _finite(loss: Any) -> bool:
    import paddle

    return bool(paddle.isfinite(loss.detach()).all())
