"""Every decoder-only family of the installed transformers keeps the outcome docs/families.md records (issue 49).

``tests/family_sweep.py`` builds each family tiny and runs it through dualkv on one GRPO batch against the
unmodified model; its outcome (packed and exact, refused with a reason, torch.compile alone fails, not
buildable) and detail must equal the committed table's row, so a family that regresses (was packed, now
refused or inexact; was refused for one reason, now for another) fails here. A few representative families
run in ``make test``; every other one is ``slow`` (``make test-slow``). When a change is intended, regenerate
the table: ``python -m tests.family_sweep --write docs/families.md``.
"""

from __future__ import annotations

import pytest

from . import family_sweep as sweep

pytestmark = pytest.mark.usefixtures("one_thread")

# One of each kind (dense, windowed and softcapped families run in make test's own model tests): learned
# positions and Conv1D (gpt2), MoE (qwen3_moe), latent attention with group-limited routing (deepseek_v3),
# learnable sinks and binding windows (gpt_oss), an encoder's LM head as a decoder with key biases (bert), a
# state-space model (mamba), an assistant model that needs its target model's states (gemma4_assistant), a model
# torch.compile alone fails on (doge); the linear-attention hybrids run in tests/test_hybrid_compile.py.
FAST = ["gpt2", "qwen3_moe", "deepseek_v3", "gpt_oss", "bert", "mamba", "gemma4_assistant", "doge"]
SLOW = [f for f in sweep.families() if f not in FAST]

BUGS = (sweep.INEXACT, sweep.DUALKV_RAISES, sweep.DUALKV_HANGS)
REGENERATE = "if the change is intended, regenerate the table: python -m tests.family_sweep --write docs/families.md"


@pytest.fixture(scope="module")
def table():
    return sweep.read_table()


def _check(family, table):
    assert family in table, f"{family} has no row in {sweep.TABLE.name}; {REGENERATE}"
    outcome, detail = table[family]
    if outcome in BUGS:  # not run again (a crash or a hang would take the test process down): a bug, reported
        pytest.fail(f"{family}: the table records a dualkv bug, {outcome}: {detail}")
    got = sweep.run_family(family)
    assert got.key() == table[family], (
        f"{family}: the table records {table[family]}, now {got.key()} ({got.seconds:.0f} s); {REGENERATE}")


@pytest.mark.parametrize("family", FAST)
def test_family_keeps_its_recorded_outcome(family, table):
    _check(family, table)


@pytest.mark.slow
@pytest.mark.parametrize("family", SLOW)
def test_family_keeps_its_recorded_outcome_slow(family, table):
    _check(family, table)


def test_table_lists_every_decoder_only_family(table):
    missing = sorted(set(sweep.families()) - set(table))
    gone = sorted(set(table) - set(sweep.families()))
    assert not missing, f"families of transformers without a row in {sweep.TABLE.name}: {missing}; {REGENERATE}"
    # An older transformers lacks the newer families' rows' models: only the version the table was made with
    # must have every row (a newer one must still give each of its families a row, above).
    if sweep.TABLE.read_text().find(f"transformers {sweep.transformers.__version__} ") >= 0:
        assert not gone, f"rows in {sweep.TABLE.name} for families transformers no longer has as decoder-only: {gone}"
    assert sweep.read_excluded() == set(sweep.excluded()), "the table's 'Not in the sweep' list is out of date"


def test_fast_families_cover_every_outcome_the_table_has(table):
    outcomes = {o for o, _ in table.values()}
    assert outcomes <= set(sweep.OUTCOMES)
    assert {table[f][0] for f in FAST if f in table} >= outcomes & {sweep.PACKED, sweep.REFUSED, sweep.COMPILE_FAILS, sweep.NOT_BUILDABLE}
