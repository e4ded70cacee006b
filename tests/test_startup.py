"""trainer/startup.py: the collector off during a process's setup, frozen survivors after."""

import gc

import pytest

from trainer import cli, startup


@pytest.fixture
def collector():
    """Whatever a test does to the collector, the worker gets it back on and unfrozen."""
    yield
    startup.end()
    gc.unfreeze()
    gc.enable()


def test_setup_runs_without_collections_and_training_with_a_frozen_heap(collector):
    startup.begin()
    assert not gc.isenabled()
    garbage = [[] for _ in range(5000)]
    for item in garbage:
        item.append(item)  # 5,000 cycles: gen-0 collections would run if the collector were on
    del garbage, item
    startup.settle()
    assert gc.isenabled() and gc.get_freeze_count() > 0
    record = startup.report()
    assert record["gc_collections"] == 0 and record["seconds"] >= 0
    startup.settle()  # once only
    assert startup.report() == record


def test_a_library_call_leaves_the_collector_as_it_was(collector, capsys, monkeypatch):
    assert cli.main(["config", "check"]) == 0
    monkeypatch.setattr("sys.argv", ["trainer", "config", "check"])
    assert cli.main() == 0  # from Python, even without argv: not the process's entry point
    assert gc.isenabled() and gc.get_freeze_count() == 0 and startup.report() is None
    gc.disable()  # someone else turned it off: begin() leaves it to them
    startup.begin()
    startup.settle()
    assert not gc.isenabled() and startup.report() is None


def test_the_entry_point_imports_with_the_collector_off_and_turns_it_back_on(
    collector, monkeypatch, capsys
):
    monkeypatch.setattr("sys.argv", ["trainer", "config", "check"])
    assert cli.entry() == 0 and gc.isenabled()  # a short command settles before it runs
    gc.unfreeze()
    seen = []
    monkeypatch.setattr(cli, "_main", lambda argv: seen.append(gc.isenabled()) or 0)
    assert cli.entry() == 0  # a command that never settles: end() turns the collector back on
    assert seen == [False] and gc.isenabled() and gc.get_freeze_count() == 0
