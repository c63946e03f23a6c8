"""bench/torch_overhead.py's side-by-side timing, without a GPU: a fake clock and callables
whose cost drifts from round to round."""

from __future__ import annotations

import contextlib

import pytest
from flashgen.bench.torch_overhead import meets_bar, paired_ratio, paired_us


class FakeHost:
    """A clock that callables advance by their cost times the host's current slowness."""

    def __init__(self):
        self.now, self.slowness, self.log = 0.0, 1.0, []

    def clock(self) -> float:
        return self.now

    def callable(self, name: str, cost: float):
        def run():
            self.log.append(name)
            self.now += cost * self.slowness

        return run


def test_same_round_ratios_cancel_a_drifting_host():
    host = FakeHost()
    fns = {"flashgen": host.callable("flashgen", 2e-6), "flash": host.callable("flash", 1e-6)}

    def sync():  # the host slows down after every loop: 1x, 1.1x, 1.2x, ...
        host.slowness += 0.1

    samples = paired_us(fns, iters=10, warmup=3, repeats=5, sync=sync, clock=host.clock)
    assert [len(v) for v in samples.values()] == [5, 5]
    # the two callables of a round ran at different speeds, yet each round's ratio is within
    # the one step of drift between them, and their median is ~2
    assert 1.8 < paired_ratio(samples, "flashgen", "flash") < 2.2
    assert all(b > a for a, b in zip(samples["flash"], samples["flash"][1:]))  # it did drift


def test_warmup_and_the_first_round_are_not_recorded_and_the_order_rotates():
    host = FakeHost()
    fns = {n: host.callable(n, 1e-6) for n in ("a", "b", "c")}
    samples = paired_us(fns, iters=2, warmup=1, repeats=3, sync=lambda: None, clock=host.clock)
    assert {n: len(v) for n, v in samples.items()} == {"a": 3, "b": 3, "c": 3}
    loops = [host.log[i] for i in range(3, len(host.log), 2)]  # after the 3 warm-up calls
    assert loops == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]


def test_contexts_are_made_fresh_around_every_loop_of_their_callable():
    host = FakeHost()
    entered = []

    @contextlib.contextmanager  # single use, as torch's sdpa_kernel
    def ctx():
        entered.append(host.log.count("x"))
        yield

    fns = {"x": host.callable("x", 1e-6), "y": host.callable("y", 1e-6)}
    paired_us(fns, iters=4, warmup=2, repeats=2, sync=lambda: None, clock=host.clock,
              contexts={"x": ctx})  # fmt: skip
    assert entered == [0, 2, 6, 10]  # the warm-up, the unrecorded round and two rounds


@pytest.mark.parametrize(
    ("case", "path", "ratio", "met"),
    [
        ("kvcache", "binding", 0.99, True),
        ("kvcache", "binding", 1.0, True),
        ("kvcache", "binding", 1.01, False),
        ("kvcache", "ctypes", 0.5, False),  # the bar is the compiled binding's
        ("varlen", "binding", None, False),  # SDPA refused the shape: no ratio
        ("merge_states", "binding", 0.5, None),  # no SDPA counterpart
    ],
)
def test_the_bar_is_the_binding_at_most_sdpa_flash_by_the_paired_ratio(case, path, ratio, met):
    assert meets_bar(case, path, ratio) is met
