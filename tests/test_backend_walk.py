"""A graph's walk through ``dualkv_backend`` (``benchmarks/probes/backend_walk.py``): the pipeline visits each stage's
files in order, reaching back into an earlier stage at most 3 times, in at most 45 stops (issue 50's bound)."""

from __future__ import annotations

from benchmarks.probes.backend_walk import Walk, tiny_grpo, walk


def test_walk_counts_stops_returns_and_climbs():
    w = Walk(["config.py", "normalize/a.py", "analysis/b.py", "graph/meta.py", "normalize/a.py", "rewrite/c.py",
              "plan/d.py", "analysis/b.py", "runtime/e.py"])
    assert len(w.stops) == 9 and w.files == 7
    assert w.returns == 2  # normalize/a.py and analysis/b.py again
    assert w.climbs == 2  # analysis -> (graph: no stage) -> normalize, plan -> analysis


def test_a_packed_graphs_walk_stays_within_the_bound():
    fn, args = tiny_grpo()
    walks = walk(fn, *args)
    assert walks, "no backend call"
    rewritten = walks[0]
    assert "runtime/runner.py" in rewritten.stops, rewritten.stops  # the graph was rewritten: the runner was built
    assert len(rewritten.stops) <= 45 and rewritten.climbs <= 3, rewritten.summary()
