"""scripts/train_eagle_demo.py's phases: each fine-tunes the previous one's head, and an export
keeps the records and loss curves of the phases before it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def script(load_script):
    return load_script("scripts/train_eagle_demo.py")


def test_every_later_phase_fine_tunes_the_one_before(script):
    assert script.PHASES[1].init is None
    for k in sorted(script.PHASES)[1:]:
        assert script.PHASES[k].init == k - 1
    heads = [p.head for p in script.PHASES.values()]
    ckpts = [p.ckpt for p in script.PHASES.values()]
    assert len(set(heads)) == len(heads) and len(set(ckpts)) == len(ckpts)


def _ship(out: Path, record: dict, curves: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "training_record.json").write_text(json.dumps(record))
    for c in curves:
        (out / c).write_text(c)   # (a curve's name as its content: which file was copied)


def test_earlier_records_from_the_previous_phase_and_a_re_export(script, tmp_path, monkeypatch):
    out, work = tmp_path / "shipped", tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(script, "OUT", out)
    phase1 = {"steps": 800, "heldout_files": ["a.py"]}   # (phase 1's record names no phase)
    _ship(out, phase1, ["training_loss.png"])
    assert script.earlier_records(work, 1) == {} and script.check_order(1) == 1
    monkeypatch.setattr(script, "OUT", tmp_path / "nothing shipped")
    assert script.check_order(1) == 1   # phase 1 needs no earlier head
    monkeypatch.setattr(script, "OUT", out)
    assert script.earlier_records(work, 2) == {1: {"steps": 800}}   # phase 2 after phase 1, as shipped
    assert (work / "training_loss_phase1.png").read_text() == "training_loss.png"
    phase2 = {"phase": 2, "steps": 400, "heldout_files": ["a.py"], "phase1": phase1}
    _ship(out, phase2, ["training_loss.png", "training_loss_phase1.png"])
    assert script.earlier_records(work, 2) == {1: {"steps": 800}}   # phase 2 again
    assert (work / "training_loss_phase1.png").read_text() == "training_loss_phase1.png"
    got = script.earlier_records(work, 3)   # phase 3 after the shipped phase 2
    assert got == {1: {"steps": 800}, 2: {"phase": 2, "steps": 400}}
    assert (work / "training_loss_phase2.png").read_text() == "training_loss.png"
    assert (work / "training_loss_phase1.png").read_text() == "training_loss_phase1.png"
    # exporting phase 3 again: its record keeps phases 1 and 2 nested, and their curves
    _ship(out, {"phase": 3, "phase1": phase1, "phase2": {"phase": 2, "steps": 400}},
          ["training_loss.png", "training_loss_phase1.png", "training_loss_phase2.png"])
    assert script.earlier_records(work, 3) == got
    assert (work / "training_loss_phase2.png").read_text() == "training_loss_phase2.png"
    _ship(out, phase1, ["training_loss.png"])
    with pytest.raises(SystemExit, match="in order"):   # phase 3 before phase 2
        script.earlier_records(work, 3)
