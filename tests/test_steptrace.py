"""The step trace a benchmark reads (gpunet.worker.steptrace): off unless asked, one whole JSON line per step."""

import json

from gpunet.worker import steptrace


def test_no_marks_are_kept_unless_a_directory_is_named(monkeypatch):
    monkeypatch.setattr(steptrace, "DIRECTORY", None)
    marks = steptrace.begin()
    steptrace.mark(marks, "input")  # a no-op on None
    assert marks is None


def test_each_step_is_one_line_with_its_marks_in_order(monkeypatch, tmp_path):
    monkeypatch.setattr(steptrace, "DIRECTORY", str(tmp_path))
    for step in range(2):
        marks = steptrace.begin()
        steptrace.mark(marks, "input")
        marks.update(zip(steptrace.EXECUTOR_MARKS, (1, 2, 3, 4)))
        steptrace.mark(marks, "answered")
        steptrace.write("12D3KooWpeer", "s1", step, marks)
    lines = [json.loads(line) for line in (tmp_path / "12D3KooWpeer.jsonl").read_text().splitlines()]
    assert [(m["session"], m["step"]) for m in lines] == [("s1", 0), ("s1", 1)]
    assert all(m["arrived"] <= m["input"] <= m["answered"] and m["began"] == 2 for m in lines)
